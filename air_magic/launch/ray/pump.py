"""A Ray call's pump: one thread per job that does every blocking Ray call and reports launcher events.

It starts the ranks (starting.py: a hot world of the same world, a spare
actor set of its shape, or a new placement), long-polls each actor for
output and for its outcome, and tears everything down: the ranks' own
child processes, the actors, the placement group; after a call whose
actors ended it starts the next spare set (spares.py). What a node sends is
appended to the rank's log in the run directory here, with its MLflow and
chart lines and its result (received.py). A rank whose actor or node dies is reported as a `WorkerDiedError`.
The runner sees only the events.

A session's call (`JobRequest.session`) runs in the session's world and keeps
it when every rank that failed stays usable (`RankFiles.session_kept`). A stop
with `interrupt_after` waits that long, raises KeyboardInterrupt in each rank
still running (`RankActor.interrupt`) and gives them a few seconds before it
stops them as any stop does (ending.py decides). When the world ends,
`SessionEnded` says why, before `JobGone`.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from typing import Any

from ...errors import WorkerDiedError
from .. import protocol as p
from ..boot import INTERNAL_ERROR
from ..files.rundir import RunDir
from ..interface import JobHandle, drain
from ..keeper import Keeper, SessionBusy
from . import spares
from .cluster import alive_nodes
from .ending import SessionCall
from .hot import HotWorld
from .placement import LaunchError, end_actors
from .received import Received
from .starting import JobLauncher, Starting, Stopped

#: Seconds an actor's poll waits for new output before it answers with none.
POLL_WAIT = 0.5
#: Seconds a stop waits for the stacks of ranks still running, and again for the output that carries them, on a
#: machine with a core free (stretched by stacks.patience() on a busy one).
STACKS_WAIT = 5.0


class RayJob(Starting, JobHandle):
    """One job on the cluster: its pump thread and the events it reports."""

    def __init__(self, launcher: JobLauncher, request: p.JobRequest, run_dir: RunDir, ray: Any) -> None:
        self.launcher = launcher
        self.request = request
        self.run_dir = run_dir
        self.ray = ray
        self.job = request.job_id
        self.per_node = request.world_size // request.num_nodes
        self.events: queue.Queue[p.Event] = queue.Queue()
        self.stop_asked = threading.Event()
        self.grace = 3.0
        self.actors: list[Any] = []
        self.infos: list[p.ActorPlace] = []
        self.pg: Any = None
        #: The call placed its actors (fresh or a spare set), with this runtime environment for its packages.
        self.placed = False
        self.runtime_env: dict[str, Any] | None = None
        #: The hot world this call runs in (reused, or made by this call when it asks for keep_alive).
        self.world: HotWorld | None = None
        self.started: set[int] = set()
        self.exited: set[int] = set()
        self.codes: dict[int, int] = {}
        self.failed = False
        #: Why the job failed to launch or lost something, as said in its LaunchFailed.
        self.failure = ""
        #: The calls were sent to the ranks: an interrupt now asks them to come back rather than stopping the job.
        self.calling = False
        #: Why the last stop was asked (StopReason's words).
        self.stop_reason = ""
        #: When the ranks were last asked for their stacks on request (time.monotonic()); None: never.
        self.stacks_asked_at: float | None = None
        self.session = SessionCall(request.session)
        #: The interrupts sent (RankActor.interrupt) not yet answered: their answer -> the rank.
        self.interrupts: dict[Any, int] = {}
        self.received = Received(run_dir, request.world_size)
        self.thread = threading.Thread(target=self._pump, name=f"air_magic-ray-{self.job[:8]}", daemon=True)
        self.thread.start()

    # -- the JobHandle side (the runner's thread) ---------------------------
    def next_events(self, timeout: float) -> list[p.Event]:
        return drain(self.events, timeout)

    def stop(self, reason: str, grace: float, interrupt_after: float | None = None) -> None:
        self.grace = grace
        if (
            interrupt_after is not None
            and not self.stop_asked.is_set()
            and self.session.ask_back(reason, interrupt_after)
        ):
            return  # the pump carries it out (_watch)
        self.stop_reason = reason
        self.stop_asked.set()

    def end_session(self, why: str) -> None:
        """Stop this session's call now and end its world, saying `why`."""
        self.session.ends(why)
        self.stop("session ended", self.grace)

    def close(self) -> None:
        self.stop_asked.set()  # a no-op after JobGone; otherwise the pump tears down and ends alone
        self.launcher.forget(self)

    def dump_stacks(self) -> None:
        self.stacks_asked_at = time.monotonic()
        for rank in sorted(self.started - self.exited):
            with contextlib.suppress(Exception):
                self.actors[rank].dump_stacks.remote("on request")  # arrives with the rank's next output

    def request_stop(self) -> None:
        for rank in sorted(self.started - self.exited):
            with contextlib.suppress(Exception):
                self.actors[rank].request_stop.remote()  # the rank's should_stop() sees it at its next look

    # -- the pump (its own thread) ------------------------------------------
    def _pump(self) -> None:
        try:
            world = self.launcher.take_hot(self.request)
            if world is None or not self._run_hot(world):
                self._await_prestart()
                self._place()
                self._start_ranks()
            self._watch()
        except Stopped:
            pass
        except (LaunchError, SessionBusy) as exc:
            self._fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the runner, never raised in a thread
            self._fail(f"the Ray launcher failed: {type(exc).__name__}: {exc}")
        finally:
            try:
                self._keep_or_teardown()
            except Exception as exc:  # noqa: BLE001
                self._fail(f"tearing the job down failed: {type(exc).__name__}: {exc}")
            if self.placed and self.started and self.world is None and self.stop_reason != "shutdown":
                with contextlib.suppress(Exception):  # no spare: the next call places as this one did
                    spares.start(self.launcher, self.launcher.actor_class(), self.request, self.runtime_env)
            for rank in sorted(self.started - self.exited):
                self._flush_decoder(rank)
                self.events.put(p.RankExited(self.job, rank, -signal.SIGKILL, time.time()))
            self.events.put(p.JobGone(self.job))

    def _fail(self, message: str) -> None:
        self.failed = True
        self.failure = self.failure or message
        self.events.put(p.LaunchFailed(self.job, message))

    def _end_world(self) -> None:
        """End the actors and placement group this job holds, and the hot world they belong to."""
        actors, pg, world = self.actors, self.pg, self.world
        self.actors, self.pg, self.infos, self.world = [], None, [], None
        if world is not None:
            self.launcher.drop(world)
        end_actors(self.ray, actors, pg, self.grace)

    def _watch(self) -> None:
        ray = self.ray
        pending = {a.poll.remote((0, 0, 0), POLL_WAIT): r for r, a in enumerate(self.actors)}
        while pending:
            if self.stop_asked.is_set():
                return  # the teardown ends the ranks; their exits are reported after it
            self._interrupts_taken()
            gave_up = self.session.interrupting(sorted(self.started - self.exited), self._interrupt)
            if gave_up is not None:
                self.stop_reason = gave_up
                self.stop_asked.set()
                return
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.1)
            if ready:  # and whatever else is in already
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                rank = pending.pop(ref)
                report: p.RankReport | None = None
                try:
                    report = ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    pass
                except ray.exceptions.RayActorError as exc:
                    self._lost(rank, exc)
                    continue
                if report is not None:
                    self._output(rank, report)
                if report is None or report.done is None:
                    again = self.actors[rank].poll.remote(self.received.offsets(rank), POLL_WAIT)
                    pending[again] = rank
                else:
                    self._exited(rank, report.done)

    def _interrupt(self, rank: int) -> None:
        with contextlib.suppress(Exception):  # a dead actor is reported by its poll
            self.interrupts[self.actors[rank].interrupt.remote()] = rank

    def _interrupts_taken(self) -> None:
        """The ranks whose interrupt was raised in their user code (not kept while the call loads): their time to
        come back is the short one (ending.SessionCall.in_code)."""
        if not self.interrupts:
            return
        ready, _ = self.ray.wait(list(self.interrupts), num_returns=len(self.interrupts), timeout=0)
        for ref in ready:
            rank = self.interrupts.pop(ref)
            with contextlib.suppress(Exception):  # a dead actor is reported by its poll
                if self.ray.get(ref, timeout=0):
                    self.session.in_code(rank)

    def _output(self, rank: int, report: p.RankReport) -> None:
        for text in self.received.take(rank, report):
            self.events.put(p.RankOutput(self.job, rank, text))

    def _flush_decoder(self, rank: int) -> None:
        for text in self.received.rest(rank):
            self.events.put(p.RankOutput(self.job, rank, text))

    def _exited(self, rank: int, files: p.RankFiles) -> None:
        """Keep what the rank left in the run directory here, and report its exit."""
        result = self.received.outcome(rank, files)
        self._flush_decoder(rank)
        self.exited.add(rank)
        code = self.codes[rank] = INTERNAL_ERROR if files.code is None else int(files.code)
        if code != 0 and files.session_kept:
            self.session.kept.add(rank)
        self.events.put(p.RankExited(self.job, rank, code, time.time(), result))

    def _lost(self, rank: int, exc: BaseException) -> None:
        """The rank's actor died under it: its process, or its whole node."""
        self.failed = True
        info = self.infos[rank] if rank < len(self.infos) else None
        node_id = info.node_id if info is not None else ""
        alive = {n["NodeID"] for n in alive_nodes(self.ray)}
        where = f"node {info.ip if info else '?'} ({node_id[:8]})"
        if node_id and node_id not in alive:
            why = f"its {where} left the Ray cluster"
        else:
            why = f"its Ray actor (pid {info.pid if info else '?'} on {where}) died"
        detail = " ".join(str(exc).split())[:400]
        error = WorkerDiedError(
            f"rank {rank} was lost: {why}, without a Python exception from the rank. Ray said: {detail}"
        )
        self.session.ends(f"rank {rank} was lost: {why}")
        self._flush_decoder(rank)
        self.exited.add(rank)
        self.events.put(p.RankExited(self.job, rank, -signal.SIGKILL, time.time(), p.RankOutcome(error=error)))

    def _keep_or_teardown(self) -> None:
        """A hot world whose call every rank finished cleanly stays for the next call; anything else ends.

        A session's world stays also when each rank that failed stays usable (`kept`).
        """
        world = self.world
        finished = not self.failed and not self.stop_asked.is_set() and len(self.codes) == self.request.world_size
        clean = finished and all(code == 0 for code in self.codes.values())
        if world is not None and Keeper.keeps(world, clean, finished and self.session.usable(self.codes)):
            self.launcher.keep(world)
        else:
            if world is not None and world.session is not None:
                self.session.ended(self.codes, self.stop_reason if self.stop_asked.is_set() else None, self.failure)
            if self.actors and self.stop_asked.is_set():
                self._stacks_before_stopping()
            self._end_world()
        if self.session.end is not None:
            self.events.put(p.SessionEnded(self.job, self.request.session or "", self.session.end))

    def _stacks_before_stopping(self) -> None:
        """Ranks still running write their stacks to their logs, which are read here once more (STACKS_WAIT s at most
        for each: a busy node takes seconds to answer, and a stack read after the stop is lost). A Stacks request's
        dump still being written is waited for as well: the stop's dump takes its turn after it."""
        from ..load import patience
        from ..stacks import STOPPING, longest_dump

        running = sorted(self.started - self.exited)
        if not running:
            return
        wait = STACKS_WAIT * patience()  # this machine's load: a node of a simulated or small cluster shares it
        if self.stacks_asked_at is not None:
            wait += max(0.0, self.stacks_asked_at + longest_dump() - time.monotonic())
        with contextlib.suppress(Exception):
            asked = [self.actors[r].dump_stacks.remote(STOPPING) for r in running]
            self.ray.wait(asked, num_returns=len(asked), timeout=wait)
            polls = {r: self.actors[r].poll.remote(self.received.offsets(r), 0) for r in running}
            self.ray.wait(list(polls.values()), num_returns=len(polls), timeout=wait)
            for rank, ref in polls.items():
                with contextlib.suppress(Exception):
                    self._output(rank, self.ray.get(ref, timeout=0))
