"""How a Ray call's ranks start: in a hot world of the same world, in a spare set of its shape, or in a new
placement group and its actors; then the call is sent to each rank.

`Starting` is a base of `RayJob` (pump.py): its steps run in the job's pump
thread and set the job's actors, placement group and hot world. What
happens once the ranks run (their output, exits, a lost node, the end of
the world) is pump.py's; this module does not watch a call.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

from .. import protocol as p
from ..files.rundir import RunDir
from . import packages, spares
from .cluster import alive_nodes
from .cluster import warming as cluster_warming
from .deaths import died_at_start, never_answered
from .ending import SessionCall
from .hot import HotWorld, HotWorlds, world_key
from .placement import LaunchError, Placement, code_dirs, rank_envs

#: How long a placement the cluster could hold may wait for resources that are busy, in seconds.
PLACEMENT_WAIT = 45.0
#: Said in a rank's output when its actor's worker process died before it answered and the actor was started again.
RESTARTED = "this rank's Ray worker process died before it started (no code of the call ran); starting it again"
#: How long the actors of a placed job may take to start, in seconds (a busy node takes long to start Ray workers).
START_WAIT = 300.0


class JobLauncher(HotWorlds):
    """What a job asks of the launcher that started it (launcher.RayLauncher)."""

    def actor_class(self) -> Any:
        raise NotImplementedError

    def probe_task(self) -> Any:
        raise NotImplementedError

    def forget(self, job: Any) -> None:
        raise NotImplementedError


class Stopped(Exception):
    """A stop came while the job was being placed or started."""


class Starting:
    """The steps of a Ray call before its ranks run, on the state of the `RayJob` they belong to."""

    launcher: JobLauncher
    request: p.JobRequest
    run_dir: RunDir
    ray: Any
    job: str
    events: queue.Queue[p.Event]
    stop_asked: threading.Event
    actors: list[Any]
    infos: list[p.ActorPlace]
    pg: Any
    placed: bool
    runtime_env: dict[str, Any] | None
    world: HotWorld | None
    started: set[int]
    calling: bool
    stop_reason: str
    session: SessionCall
    #: The placement of a call that placed anew (set by `_place`), used to start a rank's actor again.
    placement: Placement

    def _end_world(self) -> None:
        raise NotImplementedError  # pump.py: the job's actors, placement group and hot world end

    def _await_prestart(self) -> None:
        """`prestart_workers` still starting the nodes' workers: wait for it, rather than have the nodes start more."""
        warming = cluster_warming()
        deadline = time.monotonic() + START_WAIT
        while warming is not None and warming.is_alive() and time.monotonic() < deadline:
            if self._halted():
                raise Stopped()
            warming.join(0.05)

    def _halted(self) -> bool:
        """A stop came, or an interrupt before any rank runs the call (nothing to interrupt: it is a stop)."""
        asked = self.session.interrupt
        if asked is not None and not self.calling and not self.stop_asked.is_set():
            self.stop_reason = asked.why
            self.stop_asked.set()
        return self.stop_asked.is_set()

    def _wait(self, refs: list[Any], limit: float, what: str) -> list[Any]:
        """ray.get of `refs`, giving up at a stop or after `limit` s."""
        deadline = time.monotonic() + limit
        while True:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0.2)
            if len(ready) == len(refs):
                return list(self.ray.get(refs))
            if self._halted():
                raise Stopped()
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
            self.launcher.session_lost(world, f"its ranks were lost: {why}")
            said = f"the ranks of session {world.session!r} were lost: {why}; starting new ranks (their names are gone)"
        else:
            said = f"the hot ranks of this world were lost: {why}; starting fresh ranks"
        self.events.put(p.RankOutput(self.job, 0, f"air_magic: {said}.\n"))
        self._end_world()
        return False

    def _place(self) -> None:
        """Ask for the placement group and its actors; wait until the group is placed."""
        placement = self.placement = Placement(self.ray, self.request)
        placement.check_fits()
        runtime_env = self.runtime_env = packages.prepare(self.ray, placement.bundle, self.launcher.probe_task())
        if self._halted():
            raise Stopped()
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
                raise Stopped()
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
        self.infos = self._where_each()
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

    def _where_each(self) -> list[p.ActorPlace]:
        """Each placed actor's answer to `where`. An actor whose worker process died before it answered never ran
        any code of the call: it is started again once, in its bundle, and said; a second such death, or any other
        death of an actor there, is the clear error of deaths.py (with the dead worker's exit and log)."""
        for again in (False, True):
            wheres = [a.where.remote(rank == 0) for rank, a in enumerate(self.actors)]
            try:
                return self._wait(wheres, START_WAIT, "starting the ranks' Ray actors")
            except Exception as exc:
                # a worker process that ended before it answered is started again, once (below); a second such
                # death, or any other death of an actor, is said with the dead worker's exit and log
                if again or not never_answered(exc):
                    clear = died_at_start(exc)
                    if clear is None:
                        raise
                    raise clear from exc
                for rank in self._died_before_answering(wheres):
                    self.events.put(p.RankOutput(self.job, rank, f"air_magic: {RESTARTED}\n"))
                    self.ray.kill(self.actors[rank], no_restart=True)
                    self.actors[rank] = self.placement.actor(
                        self.launcher.actor_class(), self.pg, rank, self.runtime_env
                    )
        raise AssertionError("unreachable")

    def _died_before_answering(self, wheres: list[Any]) -> list[int]:
        """The ranks whose `where` ended in a death of the kind `never_answered` reads (their actors are dead)."""
        dead = []
        for rank, ref in enumerate(wheres):
            try:
                self.ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - every death is read; an unfinished answer raises GetTimeoutError
                if never_answered(exc):
                    dead.append(rank)
        return dead

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
