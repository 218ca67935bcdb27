"""run(spec, launcher) -> JobResult: the one path every call takes, and the policy of a call.

The runner serializes the call, makes its run directory, starts it through a
`Launcher` (launch/interface.py), hands every event to the listeners (display,
tracking), enforces the timeout, turns Ctrl-C and Cancel into a stop, and
turns what the ranks left into a `JobResult`. It does not raise for a failed
call: the result carries the exception, and the front doors raise it. It
knows no process, file layout of a rank, widget or tracking store: those
belong to the launcher and to the listeners. A listener that fails is
reported as a warning and never changes the call's outcome.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
import warnings
from typing import Any

from . import payload
from .errors import (
    AirMagicError,
    ConfigurationError,
    DistributedTimeoutError,
    JobCancelledError,
    ListenerWarning,
    RunDirectoryFullError,
    SerializationError,
    WorkerDiedError,
    annotate,
    describe_returncode,
    tail_text,
)
from .events import Listener, RunContext
from .job import JobResult, JobSpec, JobStatus, RankResult, RankState
from .launch import protocol as p
from .launch.interface import JobHandle, Launcher
from .launch.rundir import RunDir
from .launch.stack_dumps import where_ranks_were
from .launch.stacks import flight_recorder_env, flight_recorder_note
from .launch.stopper import STOP_GRACE

_POLL = 0.05
#: With less free space than this under the run directory, a failed write is put down to a full disk.
DISK_FULL_BYTES = 1 << 20
__all__ = ["STOP_GRACE", "default_listeners", "run"]


def human_seconds(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds:g} s ({seconds / 3600:g} h)"
    return f"{seconds:g} s"


class _Run:
    """State of one call between launch and result."""

    def __init__(self, spec: JobSpec, listeners: list[Listener], launcher: Launcher) -> None:
        self.spec = spec
        self.listeners = listeners
        self.launcher = launcher
        self.blob = payload.serialize(spec.target, spec.args, spec.kwargs)  # fails before anything starts
        self.run_dir = RunDir.create(spec.name, spec.world_size)
        self.logs = self.run_dir.logs(spec.world_size)
        self.ctx = RunContext(spec, self.run_dir.path, self.logs)
        self.result = JobResult(
            spec, self.run_dir.path, [RankResult(r, log_path=self.logs[r]) for r in range(spec.world_size)]
        )
        self.outcomes: dict[int, p.RankOutcome] = {}
        self.stop_reason: str | None = None
        self.failures: list[int] = []  # ranks in the order their exits were seen
        self.exited_at: dict[int, float] = {}  # rank -> wall time its exit was seen
        self.launch_error: str | None = None
        self.handle: JobHandle | None = None
        self.launcher_phase: str | None = None

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

    def enter_phase(self, phase: str) -> None:
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
        env = dict(os.environ)
        hooks: list[str] = []
        for listener in self.listeners:
            env.update(self.guarded(listener, "worker_env") or {})
            hooks += [h for h in self.guarded(listener, "worker_hooks") or () if h not in hooks]
        env.update(self.spec.extra_env)
        if self.spec.uses_gpu:
            env.update(flight_recorder_env(self.run_dir.path, env))  # NCCL's, dumped on its watchdog's timeout
        env["PYTHONUNBUFFERED"] = "1"
        env["AIR_MAGIC_RUN_DIR"] = str(self.run_dir.path)
        if not self.spec.uses_gpu and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.spec.ranks_per_node))
        if not self.spec.uses_gpu and "CUDA_VISIBLE_DEVICES" not in self.spec.extra_env:
            # CPU workers on a GPU node see no GPU: `"nccl" if torch.cuda.is_available() else "gloo"` picks gloo
            env["CUDA_VISIBLE_DEVICES"] = ""
        from .launch.local import warm_default

        return p.JobRequest(
            job_id=uuid.uuid4().hex, name=self.spec.name, world_size=self.spec.world_size, payload=self.blob,
            env=env, sys_path=list(sys.path), cwd=os.getcwd(), hooks=tuple(hooks),
            # hot ranks are forks of the warm helper, whatever `warm` says
            warm=bool(self.spec.keep_alive) or (warm_default() if self.spec.warm is None else self.spec.warm),
            keep_alive=self.spec.keep_alive, world_key=self.world_key(),
            num_nodes=self.spec.num_nodes, use_gpu=self.spec.uses_gpu,
        )

    def world_key(self) -> str:
        """What two calls must share to run in the same hot ranks: world, accelerator, environment, sys.path."""
        import hashlib
        import json

        world = {
            "size": self.spec.world_size, "type": self.spec.accelerator_type, "python": sys.executable,
            "env": sorted({**os.environ, **self.spec.extra_env}.items()), "sys_path": sys.path,
        }
        return hashlib.sha256(json.dumps(world).encode()).hexdigest()

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            if self.handle is not None:
                self.handle.stop(reason, STOP_GRACE)

    def on_event(self, event: p.Event) -> bool:
        """Apply one launcher event; True when every process of the job is gone."""
        if self.ctx.phase == self.launcher_phase:
            self.enter_phase("ranks starting")  # the launcher answered
        if isinstance(event, p.RankOutput):
            self.notify("on_output", event.rank, event.text)
        elif isinstance(event, p.RankStarted):
            self.result.ranks[event.rank].pid = event.pid
            self.set_state(event.rank, RankState.RUNNING)
            if all(r.pid is not None for r in self.result.ranks):
                self.enter_phase("running")
        elif isinstance(event, p.RankExited):
            rank, code = event.rank, event.returncode
            self.result.ranks[rank].returncode = code
            self.result.ranks[rank].exited_at = self.exited_at[rank] = event.at
            self.outcomes[rank] = event.outcome
            if code == 0:
                self.set_state(rank, RankState.DONE)
            elif self.stop_reason is None or event.outcome.error is not None:
                self.failures.append(rank)
                self.set_state(rank, RankState.FAILED)
                self.stop(f"rank {rank} failed")
            else:
                self.set_state(rank, RankState.STOPPED)
        elif isinstance(event, p.LaunchFailed):
            self.launch_error = event.message
            if self.stop_reason is None:
                self.stop("launch failed")
        elif isinstance(event, p.LauncherDied):
            self.launch_error = event.message
            return True
        elif isinstance(event, p.JobGone):
            return True
        return False

    def wait(self) -> None:
        assert self.handle is not None
        deadline = None if self.spec.timeout is None else self.ctx.started_at + self.spec.timeout
        while True:
            for event in self.handle.next_events(_POLL):
                if self.on_event(event):
                    return
            self.notify("poll")
            if self.ctx.take_stacks_request():
                self.handle.dump_stacks()
            if self.ctx.cancelled:
                self.stop("cancelled")
            if deadline is not None and time.monotonic() > deadline:
                self.stop("timeout")

    def wait_stopped(self) -> None:
        """After Ctrl-C: wait for the launcher to confirm every process is gone."""
        assert self.handle is not None
        limit = time.monotonic() + STOP_GRACE + 10
        while time.monotonic() < limit:
            try:
                if any(self.on_event(e) for e in self.handle.next_events(_POLL)):
                    return
            except KeyboardInterrupt:  # a second Ctrl-C: keep cleaning up
                continue

    def execute(self) -> JobResult:
        self.launcher_phase = self.launcher.prepare()  # e.g. a helper starts (imports torch) while listeners start
        try:
            # Ctrl-C while listeners start or the launcher starts still ends the call properly: the
            # display shows it stopped, and the MLflow run ends KILLED.
            self.start_listeners()
            request = self.request()
            self.enter_phase(self.launcher_phase or "ranks starting")
            self.handle = self.launcher.start(request, self.run_dir)
            self.wait()
        except KeyboardInterrupt:
            self.stop("interrupted")
            if self.handle is not None:
                self.wait_stopped()
        except AirMagicError as exc:  # nothing could start (a full disk, a launcher that is gone)
            self.launch_error = str(exc)
        finally:
            if self.handle is not None:
                self.handle.close()
        return self.finish()

    # -- outcome -----------------------------------------------------------
    def finish(self) -> JobResult:
        self.result.elapsed = self.ctx.elapsed
        for rank in self.result.ranks:
            if rank.state in (RankState.PENDING, RankState.RUNNING):
                rank.state = RankState.STOPPED
        error = self.outcome_error()
        recorded = flight_recorder_note(self.run_dir.path) if self.spec.uses_gpu else None
        if error is not None and recorded:
            annotate(error, recorded)
        self.run_dir.release_reserves()  # after outcome_error: a full disk is judged as the ranks left it
        if error is None:
            self.result.status = JobStatus.FINISHED
        elif self.stop_reason in ("interrupted", "cancelled", "timeout"):
            self.result.status = JobStatus.KILLED
        else:
            self.result.status = JobStatus.FAILED
        self.result.error = error
        self.notify("on_end", self.result)
        return self.result

    def failed_at(self, rank: int) -> float:
        """When a rank failed: when it recorded its error, else when its exit was seen."""
        when = self.exited_at.get(rank, float("inf"))
        recorded = self.outcomes[rank].error_at if rank in self.outcomes else None
        return when if recorded is None else min(when, recorded)

    def rank_error(self, rank: int) -> BaseException:
        outcome = self.outcomes.get(rank)
        log = self.logs[rank]
        if outcome is not None and outcome.error is not None:
            return annotate(outcome.error, f"raised on rank {rank} of {self.spec.world_size}; its full log: {log}")
        code = self.result.ranks[rank].returncode or 0
        return WorkerDiedError(
            f"rank {rank} {describe_returncode(code)} without a Python exception. "
            f"Last lines of its output:\n{tail_text(log) or '(no output)'}\nFull log: {log}"
        )

    def missing_results(self) -> list[int]:
        return [r.rank for r in self.result.ranks if self.outcomes.get(r.rank, p.RankOutcome()).value is None]

    def disk_full_error(self) -> BaseException | None:
        """A rank failed or left no result while the run directory's disk is full: say so, not just 'exit 1'."""
        try:
            free = shutil.disk_usage(self.run_dir.path).free
        except OSError:
            return None
        if free >= DISK_FULL_BYTES or not (self.failures or self.launch_error or self.missing_results()):
            return None
        ranks = ", ".join(map(str, self.failures or self.missing_results()))
        error = RunDirectoryFullError(
            f"the disk holding the run directory {self.run_dir.path} is full ({free:,} bytes free), so rank(s) "
            f"{ranks} could not write their output, result or error; every worker was stopped. Free some space "
            "there, or set AIR_MAGIC_RUNS_DIR to a directory on a disk with room. What the ranks wrote before is "
            "kept there."
        )
        if self.failures:
            error.__cause__ = self.rank_error(min(self.failures, key=self.failed_at))
        return error

    def outcome_error(self) -> BaseException | None:
        where = f"Logs of every rank are in {self.run_dir.path}."
        stopped = self.stop_reason in ("interrupted", "timeout", "cancelled")
        stacks = where_ranks_were(self.logs) if stopped else None  # what each rank wrote as it was stopped
        if stacks:
            where = f"{where}\n{stacks}"
        if self.stop_reason == "interrupted":
            return annotate(KeyboardInterrupt(), stacks) if stacks else KeyboardInterrupt()
        if self.stop_reason == "timeout":
            return DistributedTimeoutError(
                f"{self.spec.name} ran longer than its timeout of {human_seconds(self.spec.timeout or 0)} "
                f"and every worker was stopped. Pass a larger timeout=... (seconds, or None for no limit) "
                f"to distributed(...), or --timeout S to %%distributed. {where}"
            )
        if self.stop_reason == "cancelled":
            return JobCancelledError(f"{self.spec.name} was cancelled; every worker was stopped. {where}")
        full = self.disk_full_error()
        if full is not None:
            return full
        if self.failures:
            # The rank that failed first is the cause; peers that lost it fail a moment later (gloo's
            # "Connection closed by peer") and may even exit sooner, so order by when each failed.
            ranks = sorted(self.failures, key=self.failed_at)
            first = self.rank_error(ranks[0])
            others = [f"rank {r}: {self.rank_error(r)!r}".splitlines()[0] for r in ranks[1:]]
            if others:
                annotate(first, "other ranks that failed too: " + "; ".join(others))
            if self.launch_error:
                annotate(first, f"air_magic: {self.launch_error}")
            return first
        if self.launch_error:
            return AirMagicError(f"air_magic could not run the job: {self.launch_error}. {where}")
        import cloudpickle

        for rank in self.result.ranks:
            blob = self.outcomes.get(rank.rank, p.RankOutcome()).value
            if blob is None:
                return AirMagicError(f"rank {rank.rank} ended without leaving a result. {where}")
            try:
                rank.value = cloudpickle.loads(blob)
            except Exception as exc:  # noqa: BLE001 - it pickled there but does not rebuild here
                error = SerializationError(
                    f"the return value of rank {rank.rank} could not be rebuilt in this process: "
                    f"{type(exc).__name__}: {exc}. Return plain data (numbers, lists, dicts, tensors) "
                    f"whose types this notebook can import. Logs of every rank are in {self.run_dir.path}."
                )
                error.__cause__ = exc
                return error
        return None


def check_supported(spec: JobSpec, launcher: Launcher) -> None:
    """Refuse, before anything starts, a setting of the call that its launcher cannot honour."""
    if spec.keep_alive and "keep_alive" not in launcher.supports:
        raise ConfigurationError(
            f"keep_alive={spec.keep_alive:g} asks for hot ranks, which {type(launcher).__name__} cannot keep "
            "between calls; leave keep_alive unset (or --keep-alive out of %%distributed) for this call."
        )


def default_listeners(spec: JobSpec) -> list[Listener]:
    """Tracking first (it makes the run link), then the display that shows it."""
    from .display import make_display

    listeners: list[Listener] = []
    if spec.mlflow:
        from .tracking import make_tracker

        tracker = make_tracker(spec)
        if tracker is not None:
            listeners.append(tracker)
    listeners.append(make_display(spec))
    return listeners


def run(spec: JobSpec, listeners: list[Listener] | None = None, launcher: Launcher | None = None) -> JobResult:
    """Run `spec` on its ranks and return every rank's outcome; a failed call's exception is in `.error`.

    Without a `launcher`: this node's local launcher, or the Ray launcher when the spec spans several nodes.
    """
    if launcher is None:
        if spec.num_nodes > 1:
            from .launch.ray import ray_launcher

            launcher = ray_launcher()
        else:
            from .launch.local import local_launcher

            launcher = local_launcher()
    check_supported(spec, launcher)
    chosen = default_listeners(spec) if listeners is None else listeners
    return _Run(spec, chosen, launcher).execute()
