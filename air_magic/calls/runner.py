"""run(spec, launcher) -> JobResult: the one path every call takes, and the policy of a call.

The runner serializes the call, makes its run directory, starts it through a
`Launcher` (launch/interface.py), hands every event to the listeners (display,
tracking), enforces the timeout, turns Ctrl-C and Cancel into a stop, and
turns what the ranks left into a `JobResult` (judged in outcome.py). It does not raise for a failed
call: the result carries the exception, and the front doors raise it. It
knows no process, file layout of a rank, widget or tracking store: those
belong to the launcher and to the listeners. A listener that fails is
reported as a warning and never changes the call's outcome.

A call's parts are put together in setup.py: `run` takes the launcher
that the owner picks (`Launchers.for_nodes`) and the listeners it plugs in
(owner/listeners.py: the resource sampler, MLflow tracking, the display).
When and how a call's ranks are stopped (a failure, the timeout, Cancel, a
Stop, the flight recorder read first) is stops.py, the runner's base.

Restarts are its policy too: when a rank of an attempt fails (raises, dies,
is killed, loses its node) and the call has `max_restarts` left, every rank
of that attempt is stopped and the launcher is asked for a new job, the same
call with the next TORCHELASTIC_RESTART_COUNT, in the same run directory
(`RunDir.begin_attempt`). Cancel, Ctrl-C, the timeout (which covers every
attempt) and an attempt in which no rank started are never restarted.

Over 300 lines because it is the one policy of a call (start, watch, debug prompts, restart, collect), kept in one
place on purpose.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
import warnings
from typing import Any

from .. import payload
from ..errors import AirMagicError, ListenerWarning, RankHungError, RunDirectoryFullError, annotate
from ..job import Alert, JobResult, JobSpec, JobStatus, RankResult, RankState, StopReason
from ..launch import protocol as p
from ..launch.come_back import LONGEST_COME_BACK
from ..launch.files import flight_recorder
from ..launch.files.rundir import RunDir, attempt_marker
from ..launch.interface import JobHandle, Launcher
from ..launch.rank import session
from ..launch.stopper import STOP_GRACE
from ..listeners import Listener, RunContext
from ..phase import Phase
from .debugging import DebugServer
from .outcome import raised_in_collective
from .setup import check_supported, job_request, world_key
from .stops import CallStops

_POLL = 0.05
__all__ = ["STOP_GRACE", "check_supported", "run", "world_key"]


class _Run(CallStops):
    """State of one call between launch and result; the attempt-level fields are reset by `begin_attempt`."""

    def __init__(
        self, spec: JobSpec, listeners: list[Listener], launcher: Launcher, run_dir: RunDir | None = None
    ) -> None:
        self.spec = spec
        self.listeners = listeners
        self.launcher = launcher
        self.blob = payload.serialize(spec.target, spec.args, spec.kwargs)  # fails before anything starts
        self.run_dir = run_dir or RunDir.create(spec.name, spec.world_size)
        self.logs = self.run_dir.logs(spec.world_size)
        self.ctx = RunContext(spec, self.run_dir.path, self.logs)
        self.result = JobResult(
            spec, self.run_dir.path, [RankResult(r, log_path=self.logs[r]) for r in range(spec.world_size)]
        )
        self.launcher_phase: Phase | None = None
        self.stop_forwarded = False  # a Stop's flag was handed to the launcher (ranks on other machines)
        self.stop_looked_at = 0.0
        #: A dump of NCCL's flight recorder was asked for with the stacks: (when, ranks asked, give up at).
        self.recorder_asked: tuple[float, set[int], float] | None = None
        #: Answers a rank's breakpoint() from this cell (a foreground call: the notebook's main thread).
        self.debugger = DebugServer(self.run_dir.path, spec.world_size)
        #: Seconds a person spent at a rank's debugger prompt: the timeout waits for them.
        self.paused = 0.0
        self.attempt = 0
        self.reset_attempt()

    def reset_attempt(self) -> None:
        """Forget what the last attempt's ranks did: a new attempt is judged on its own."""
        self.outcomes: dict[int, p.RankOutcome] = {}
        self.stop_reason: StopReason | None = None
        self.failures: list[int] = []  # ranks in the order their exits were seen
        self.exited_at: dict[int, float] = {}  # rank -> wall time its exit was seen
        self.stop_due: float | None = None  # a failure's stop waits for the peers' ends until then (stop_grace)
        self.launch_error: str | None = None
        self.hung: Alert | None = None  # a hang the watch found, which the call's on_hang stops for
        self.handle: JobHandle | None = None
        self.started: set[int] = set()  # ranks of this attempt that started
        self.gone = False  # the launcher said every process of this attempt is gone

    # -- listeners ---------------------------------------------------------
    def notify(self, hook: str, *args: Any) -> None:
        for listener in self.listeners:
            self.guarded(listener, hook, *args)

    def guarded(self, listener: Listener, hook: str, *args: Any) -> Any:
        """Call one listener hook; a failure is a warning naming it, never the call's outcome."""
        try:
            return getattr(listener, hook)(*args)
        except Exception as exc:  # noqa: BLE001 - a listener must not change what the call did
            warnings.warn(
                f"air_magic: {type(listener).__name__}.{hook} failed and was skipped "
                f"({type(exc).__name__}: {exc}); the call itself is not affected.",
                ListenerWarning,
                stacklevel=2,
            )
            return None

    def enter_phase(self, phase: Phase) -> None:
        if self.ctx.phase != phase:
            self.ctx.phases.append((phase, self.ctx.elapsed))
            self.notify("on_phase", phase)

    def start_listeners(self) -> None:
        for listener in self.listeners:
            if listener.start_phase:
                self.enter_phase(listener.start_phase)
            self.guarded(listener, "on_start", self.ctx)

    def set_state(self, rank: int, state: RankState) -> None:
        self.result.ranks[rank].state = state
        self.notify("on_rank_state", rank, state)

    # -- lifecycle ---------------------------------------------------------
    def request(self) -> p.JobRequest:
        return job_request(self.spec, self.blob, self.run_dir, self.launcher, self.listeners, self.guarded)

    def lost_peer(self, outcome: p.RankOutcome) -> bool:
        """After the caller stopped the call (Cancel, Ctrl-C, the timeout), a rank whose error came from inside a
        collective lost a peer that was stopped first: it was stopped too, it did not fail."""
        stopped = self.stop_reason is not None and self.stop_reason.by_caller
        return stopped and outcome.error is not None and raised_in_collective(outcome.error)

    def on_event(self, event: p.Event) -> bool:
        """Apply one launcher event; True when every process of the job is gone."""
        if self.ctx.phase == self.launcher_phase:
            self.enter_phase(Phase.RANKS_STARTING)  # the launcher answered
        if isinstance(event, p.RankOutput):
            self.notify("on_output", event.rank, event.text)
        elif isinstance(event, p.RankStarted):
            self.started.add(event.rank)
            self.result.ranks[event.rank].pid = self.ctx.pids[event.rank] = event.pid
            self.result.ranks[event.rank].host = event.host
            self.set_state(event.rank, RankState.RUNNING)
            if all(r.pid is not None for r in self.result.ranks):
                self.enter_phase(Phase.RUNNING)
        elif isinstance(event, p.RankExited):
            rank, code = event.rank, event.returncode
            self.result.ranks[rank].returncode = code
            self.result.ranks[rank].exited_at = self.exited_at[rank] = event.at
            self.outcomes[rank] = event.outcome
            if code == 0:
                self.set_state(rank, RankState.DONE)
            elif self.stop_reason is None or (event.outcome.error is not None and not self.lost_peer(event.outcome)):
                self.failures.append(rank)
                self.set_state(rank, RankState.FAILED)
                self.stop_after_failure()
            else:
                self.set_state(rank, RankState.STOPPED)
        elif isinstance(event, p.LaunchFailed):
            self.launch_error = event.message
            if self.stop_reason is None:
                self.stop(StopReason.LAUNCH_FAILED)
        elif isinstance(event, p.LauncherDied):
            self.launch_error = event.message
            self.gone = True
            if self.spec.session is not None:
                self.result.session_end = self.result.session_end or "its ranks went with air_magic's helper process"
        elif isinstance(event, p.SessionEnded):
            self.result.session_end = event.reason
        elif isinstance(event, p.JobGone):
            self.gone = True
        return self.gone

    def wait(self) -> None:
        assert self.handle is not None
        while True:
            for event in self.handle.next_events(_POLL):
                if self.on_event(event) or (self.handle.ends_in_background and self.all_returned()):
                    return
            self.notify("poll")
            if self.stop_reason is None:
                self.paused += self.debugger.serve()  # a person at a rank's prompt: the timeout waits too
            if self.ctx.take_stacks_request():
                self.handle.dump_stacks()
                if self.spec.uses_gpu:
                    self.dump_recorder(wait=False)
            self.read_recorder()
            self.forward_stop()
            hang = self.ctx.take_hang()  # on_hang="stop" or "restart" (watching/)
            if hang is not None and self.stop_reason is None:
                self.hung = hang
                self.stop(StopReason.RANK_FAILED)
            if self.ctx.cancelled:
                self.stop(StopReason.CANCELLED)
            if self.past_deadline():
                self.stop(StopReason.TIMEOUT)
            if self.stop_due is not None and time.monotonic() >= self.stop_due:
                self.stop(StopReason.RANK_FAILED)

    def all_returned(self) -> bool:
        """Every rank exited with success and left its outcome: the results are complete, whatever still exits."""
        return (
            self.stop_reason is None
            and self.launch_error is None
            and len(self.outcomes) == self.spec.world_size
            and all(rank.returncode == 0 for rank in self.result.ranks)
        )

    def wait_stopped(self) -> None:
        """After Ctrl-C: wait for the launcher to confirm every process is gone (a session's ranks are first given
        their time to come back from KeyboardInterrupt, longer on a busy machine)."""
        assert self.handle is not None
        limit = time.monotonic() + STOP_GRACE + 10 + (LONGEST_COME_BACK if self.spec.session else 0.0)
        while time.monotonic() < limit:
            try:
                if any(self.on_event(e) for e in self.handle.next_events(_POLL)):
                    return
            except KeyboardInterrupt:  # a second Ctrl-C: stop at once (a session's ranks too), keep cleaning up
                self.handle.stop(StopReason.INTERRUPTED.value, STOP_GRACE)
                continue

    def execute(self) -> JobResult:
        self.launcher_phase = self.launcher.prepare()  # e.g. a helper starts (imports torch) while listeners start
        error: BaseException | None = None
        try:
            # Ctrl-C while listeners start or the launcher starts still ends the call properly: the
            # display shows it stopped, and the MLflow run ends KILLED.
            self.start_listeners()
            request = self.request()
            self.enter_phase(self.launcher_phase or Phase.RANKS_STARTING)
            while True:
                self.run_attempt(dataclasses.replace(request, job_id=uuid.uuid4().hex, restart_count=self.attempt))
                error = self.outcome_error()
                if not self.restartable(error):
                    break
                assert error is not None
                self.begin_attempt(error)
        except KeyboardInterrupt:
            self.stop(StopReason.INTERRUPTED)
            if self.handle is not None and not self.gone:
                self.wait_stopped()
            error = self.outcome_error()
        except AirMagicError as exc:  # nothing could start (a full disk, a launcher that is gone)
            self.launch_error = str(exc)
            error = self.outcome_error()
        finally:
            if self.handle is not None:
                self.handle.close()
            self.debugger.close()
        return self.finish(error)

    def run_attempt(self, request: p.JobRequest) -> None:
        """Start every rank of one attempt and follow it until all its processes are gone."""
        self.handle = self.launcher.start(request, self.run_dir)
        self.wait()
        self.handle.close()

    def restartable(self, error: BaseException | None) -> bool:
        """A rank of this attempt failed after it started, and the call may and can start its world again."""
        return (
            error is not None
            and self.attempt < self.spec.max_restarts
            and bool(self.started)  # what failed before any rank ran (placement, a full disk) would fail again
            and bool(self.failures or self.launch_error or self.hung)  # not a rank whose value cannot be read
            and not (self.stop_reason is not None and self.stop_reason.by_caller)
            and not self.ctx.cancelled
            and not isinstance(error, RunDirectoryFullError)
            and not self.past_deadline()
        )

    def begin_attempt(self, error: BaseException) -> None:
        """Every process of the failed attempt is gone: ready the run directory, ranks and listeners for the next."""
        why = self.first_failure(error)
        self.result.earlier_failures.append(why)
        self.attempt += 1
        self.result.attempts = self.attempt + 1
        self.ctx.attempt = self.attempt
        self.ctx.earlier_failures.append(why)
        if self.spec.session is not None:  # a restart starts a new world: the session's state is gone
            self.result.session_restarted = f"a restart (max_restarts) started its ranks again after: {why}"
            self.launcher.end_session(self.spec.session, self.result.session_restarted)
            self.result.session_end = None  # what the last attempt leaves decides whether its world is kept
        self.reset_attempt()
        marker = attempt_marker(self.attempt, self.ctx.attempts_allowed, why)
        self.run_dir.begin_attempt(self.attempt, self.spec.world_size, marker)
        for rank in self.result.ranks:
            rank.pid = rank.returncode = rank.exited_at = None
            rank.value = None
            self.set_state(rank.rank, RankState.PENDING)
        self.notify("on_attempt", self.attempt, why)

    # -- outcome -----------------------------------------------------------
    def outcome_error(self) -> BaseException | None:
        """A hang the call stopped for (on_hang) is its error, unless a rank failed by itself meanwhile."""
        if self.hung is not None and not self.failures and self.stop_reason == StopReason.RANK_FAILED:
            return RankHungError(
                f"{self.hung.message}. air_magic stopped every rank (on_hang={self.spec.on_hang!r}). "
                f"Logs of every rank are in {self.run_dir.path}."
            )
        return super().outcome_error()

    def finish(self, error: BaseException | None) -> JobResult:
        """`error`: the last attempt's, from outcome_error() (a full disk is judged as the ranks left it)."""
        self.result.elapsed = self.ctx.elapsed
        for rank in self.result.ranks:
            if rank.state in (RankState.PENDING, RankState.RUNNING):
                rank.state = RankState.STOPPED
        gpu = self.spec.uses_gpu
        recorded = flight_recorder.recorder_note(self.run_dir.path, self.spec.world_size) if gpu else None
        if error is not None and recorded:
            annotate(error, recorded)
        self.run_dir.release_reserves()
        if error is None:
            self.result.status = JobStatus.FINISHED
        elif self.stop_reason is not None and self.stop_reason.by_caller:
            self.result.status = JobStatus.KILLED
        else:
            self.result.status = JobStatus.FAILED
        if error is not None and self.result.earlier_failures:
            annotate(error, self.earlier_note())
        if self.spec.session is not None:
            self.unwrap_session_replies()
            if error is not None:
                annotate(error, self.session_note())
        self.result.error = error
        self.result.alerts = list(self.ctx.alerts)
        self.notify("on_end", self.result)
        return self.result

    def unwrap_session_replies(self) -> None:
        """A session rank answers with its value and the names it holds: keep the value, note the names."""
        for rank in self.result.ranks:
            if isinstance(rank.value, session.Reply):
                self.result.session_names[rank.rank] = rank.value.names
                rank.value = rank.value.value

    def session_note(self) -> str:
        """What became of the session after a failed call: kept with what it holds, or ended, and why."""
        name = self.spec.session
        if self.result.session_end is None and self.result.session_restarted is not None:
            restarted = self.result.session_restarted
            return (
                f"air_magic: session {name!r} was kept in the ranks the restart started ({restarted}): what it "
                "held before the restart is gone; its ranks hold what this cell did before it stopped."
            )
        if self.result.session_end is None:
            return (
                f"air_magic: session {name!r} was kept: its ranks hold what they held, plus what this cell did "
                "before it stopped."
            )
        why = self.result.session_end
        return f"air_magic: session {name!r} ended: {why}. The next --session {name} cell starts new ranks."


def run(
    spec: JobSpec,
    listeners: list[Listener] | None,
    launcher: Launcher,
    run_dir: RunDir | None = None,
) -> JobResult:
    """Run `spec` on its ranks through `launcher` and return every rank's outcome; a failed call's exception is in
    `.error`. The owner (air_magic/owner/) is the one caller: it picks the launcher and holds the call's units.

    `run_dir`: a run directory made already (RunDir.create), whose name is the call's id; else one is made here.
    """
    check_supported(spec, launcher)
    chosen = listeners or []
    return _Run(spec, chosen, launcher, run_dir).execute()
