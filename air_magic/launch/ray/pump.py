"""A Ray call's pump: one thread per job that does every blocking Ray call and reports launcher events.

It places the job (placement.py), in a spare actor set of its shape when
there is one (spares.py, which starts the next after the call), or takes a
hot world of the same world (hot.py), starts the ranks, long-polls each
actor for output and for its outcome, and tears everything down: the ranks'
own child processes, the actors, the placement group. What a node sends is
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
import dataclasses
import queue
import signal
import threading
import time
from typing import Any

from ...errors import WorkerDiedError
from .. import protocol as p
from ..boot import INTERNAL_ERROR
from ..interface import JobHandle, drain
from ..rundir import RunDir
from . import packages, spares
from .cluster import alive_nodes
from .cluster import warming as cluster_warming
from .ending import SessionCall
from .hot import HotWorld, HotWorlds, SessionBusy, world_key
from .placement import LaunchError, Placement, code_dirs, end_actors, rank_envs
from .received import Received

#: How long a placement the cluster could hold may wait for resources that are busy, in seconds.
PLACEMENT_WAIT = 45.0
#: How long the actors of a placed job may take to start, in seconds (a busy node takes long to start Ray workers).
START_WAIT = 300.0
#: Seconds an actor's poll waits for new output before it answers with none.
POLL_WAIT = 0.5


class Owner(HotWorlds):
    """What a job asks of the launcher that started it (launcher.RayLauncher)."""

    def actor_class(self) -> Any:
        raise NotImplementedError

    def probe_task(self) -> Any:
        raise NotImplementedError

    def forget(self, job: RayJob) -> None:
        raise NotImplementedError


class _Stopped(Exception):
    """A stop came while the job was being placed or started."""


class RayJob(JobHandle):
    """One job on the cluster: its pump thread and the events it reports."""

    def __init__(self, launcher: Owner, request: p.JobRequest, run_dir: RunDir, ray: Any) -> None:
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
        self.session = SessionCall(request.session)
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
        for rank in sorted(self.started - self.exited):
            with contextlib.suppress(Exception):
                self.actors[rank].dump_stacks.remote("on request")  # arrives with the rank's next output

    # -- the pump (its own thread) ------------------------------------------
    def _pump(self) -> None:
        try:
            world = self.launcher.take_hot(self.request)
            if world is None or not self._run_hot(world):
                self._await_prestart()
                self._place()
                self._start_ranks()
            self._watch()
        except _Stopped:
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

    def _await_prestart(self) -> None:
        """`prestart_workers` still starting the nodes' workers: wait for it, rather than have the nodes start more."""
        warming = cluster_warming()
        deadline = time.monotonic() + START_WAIT
        while warming is not None and warming.is_alive() and time.monotonic() < deadline:
            if self._halted():
                raise _Stopped()
            warming.join(0.05)

    def _halted(self) -> bool:
        """A stop came, or an interrupt before any rank runs the call (nothing to interrupt: it is a stop)."""
        asked = self.session.interrupt
        if asked is not None and not self.calling and not self.stop_asked.is_set():
            self.stop_reason = asked.why
            self.stop_asked.set()
        return self.stop_asked.is_set()

    def _fail(self, message: str) -> None:
        self.failed = True
        self.failure = self.failure or message
        self.events.put(p.LaunchFailed(self.job, message))

    def _wait(self, refs: list[Any], limit: float, what: str) -> list[Any]:
        """ray.get of `refs`, giving up at a stop or after `limit` s."""
        deadline = time.monotonic() + limit
        while True:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0.2)
            if len(ready) == len(refs):
                return list(self.ray.get(refs))
            if self._halted():
                raise _Stopped()
            if time.monotonic() > deadline:
                raise LaunchError(f"{what} did not happen within {limit:g} s")

    def _run_hot(self, world: HotWorld) -> bool:
        """Start the call in the hot world's actors; False (the world ended) if a node or actor of it was lost."""
        self.world, self.actors, self.pg, self.infos = world, world.actors, world.pg, world.places
        alive = {n["NodeID"] for n in alive_nodes(self.ray)}
        lost = [pl for pl in world.places if pl.node_id not in alive]
        why = f"node {lost[0].ip} ({lost[0].node_id[:8]}) left the Ray cluster" if lost else ""
        if not lost:
            try:
                self._start_calls(world.master, world.port)
                return True
            except self.ray.exceptions.RayActorError as exc:
                why = f"a Ray actor of theirs died ({' '.join(str(exc).split())[:200]})"
        if world.session is not None:
            self.launcher.session_lost(world.session, f"its ranks were lost: {why}")
            said = f"the ranks of session {world.session!r} were lost: {why}; starting new ranks (their names are gone)"
        else:
            said = f"the hot ranks of this world were lost: {why}; starting fresh ranks"
        self.events.put(p.RankOutput(self.job, 0, f"air_magic: {said}.\n"))
        self._end_world()
        return False

    def _end_world(self) -> None:
        """End the actors and placement group this job holds, and the hot world they belong to."""
        actors, pg, world = self.actors, self.pg, self.world
        self.actors, self.pg, self.infos, self.world = [], None, [], None
        if world is not None:
            self.launcher.drop(world)
        end_actors(self.ray, actors, pg, self.grace)

    def _place(self) -> None:
        """Ask for the placement group and its actors; wait until the group is placed."""
        placement = Placement(self.ray, self.request)
        placement.check_fits()
        runtime_env = self.runtime_env = packages.prepare(self.ray, placement.bundle, self.launcher.probe_task())
        if self._halted():
            raise _Stopped()
        spare = spares.take(self.launcher, self.request, runtime_env)
        if spare is not None:
            self.pg, self.actors = spare.pg, spare.actors
        else:
            name = f"air_magic-{self.job[:12]}"
            self.pg, self.actors = placement.reserve(self.launcher.actor_class(), name, runtime_env)
        self.placed = True
        deadline = time.monotonic() + PLACEMENT_WAIT
        ready = self.pg.ready()
        while not self.ray.wait([ready], timeout=0.2)[0]:
            # idle hot ranks or spares may hold what this call needs: it comes first (a session's are held until
            # it ends); what is free already is left to the group, which Ray places in a moment
            if self.launcher.holding() and not placement.free_now():
                self.launcher.release_hot(sessions=False)
            if self._halted():
                raise _Stopped()
            if time.monotonic() > deadline:
                sessions = sorted(str(w.session) for w in self.launcher.idle_sessions())
                held = (
                    f" Idle session(s) {', '.join(map(repr, sessions))} hold ranks: %distributed_session --end NAME "
                    "frees them."
                    if sessions
                    else ""
                )
                raise LaunchError(
                    f"the Ray cluster could not reserve {placement.asked} within {PLACEMENT_WAIT:g} s: other work "
                    f"holds them. {placement.free_text()}{held}"
                )

    def _start_ranks(self) -> None:
        """The placed actors: where each runs (rank 0 picks MASTER_PORT), then the call in each."""
        wheres = [a.where.remote(rank == 0) for rank, a in enumerate(self.actors)]
        self.infos = self._wait(wheres, START_WAIT, "starting the ranks' Ray actors")
        master, port = self.infos[0].ip, self.infos[0].free_port
        if self.request.keep_alive:
            self.world = HotWorld(
                world_key(self.request),
                self.actors,
                self.pg,
                self.infos,
                master,
                port,
                float(self.request.keep_alive),
                session=self.request.session,
            )
        self._start_calls(master, port)

    def _start_calls(self, master: str, port: int) -> None:
        req = self.request
        self.calling = True
        payload = self.ray.put(req.payload)  # through the object store, fetched by each node once
        job = dataclasses.replace(p.JobFile.of(req), sys_path=code_dirs(req.sys_path))
        envs = rank_envs(req, self.infos, master, port, run_id=self.run_dir.path.name)
        refs = [
            actor.start.remote(p.RankCall(rank, job, envs[rank], hot=bool(req.keep_alive)), payload)
            for rank, actor in enumerate(self.actors)
        ]
        for rank, pid in enumerate(self._wait(refs, START_WAIT, "starting the ranks")):
            self.started.add(rank)
            self.events.put(p.RankStarted(self.job, rank, int(pid), self.infos[rank].ip))

    def _watch(self) -> None:
        ray = self.ray
        pending = {a.poll.remote((0, 0, 0), POLL_WAIT): r for r, a in enumerate(self.actors)}
        while pending:
            if self.stop_asked.is_set():
                return  # the teardown ends the ranks; their exits are reported after it
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
            self.actors[rank].interrupt.remote()

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
        clean = (
            world is not None
            and not self.failed
            and not self.stop_asked.is_set()
            and len(self.codes) == self.request.world_size
            and self.session.usable(self.codes)
        )
        if clean and world is not None:
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
        """Ranks still running write their stacks to their logs, which are read here once more (a second at most)."""
        from ..stacks import STOPPING

        running = sorted(self.started - self.exited)
        if not running:
            return
        with contextlib.suppress(Exception):
            asked = [self.actors[r].dump_stacks.remote(STOPPING) for r in running]
            self.ray.wait(asked, num_returns=len(asked), timeout=1.0)
            polls = {r: self.actors[r].poll.remote(self.received.offsets(r), 0) for r in running}
            self.ray.wait(list(polls.values()), num_returns=len(polls), timeout=1.0)
            for rank, ref in polls.items():
                with contextlib.suppress(Exception):
                    self._output(rank, self.ray.get(ref, timeout=0))
