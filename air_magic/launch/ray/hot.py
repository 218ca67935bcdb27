"""Hot worlds on Ray: the actors of a call kept for the next call of the same world, and when they end.

After a call in which every rank succeeded, its actors, their placement group,
what they imported and their default process group stay as a `HotWorld`; the
next call of the same world (`world_key`, node count, ranks per node, GPU or
not) runs in them, with the first call's MASTER_ADDR and MASTER_PORT. A hot
world ends when it has been idle `keep_alive` s, when a call in it fails or is
stopped (cancel, timeout, Ctrl-C), on `release_hot()` or `shutdown()`, and
when a call of another world waits for resources (idle hot ranks may hold
them). `HotWorlds` is that registry; it asks Ray for nothing but the end of a
world's actors (placement.end_actors).

A session's world (`JobRequest.session`) is found by the session's name, not
by its world: a call of the session runs in it whatever its environment, and
the pump keeps it after a call that failed in user code. Another call never
takes it, and a call waiting for resources does not end it (its memory is held
until it ends). Its end outside a call (idle, released) is kept for
`ended_sessions`, once.

Spare actor sets (spares.py: started ahead of the next cold call of a shape,
`HotWorld.spare`) live in the same registry and end by the same rules: idle
their time, a call waiting for resources, `release_hot()`, `shutdown()`. No
call takes one as a hot world; `take_spare` hands one to a call that places.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from .. import protocol as p
from .cluster import require_connected
from .placement import end_actors


@dataclass(eq=False)
class HotWorld:
    """Actors kept between calls of one world: their placement group, where they run, where their group meets."""

    key: str
    actors: list[Any]
    pg: Any
    places: list[p.ActorPlace]
    master: str
    port: int
    keep_alive: float
    #: The session it holds, if any.
    session: str | None = None
    #: A call runs in it now.
    busy: bool = True
    #: Ends it once it has been idle `keep_alive` s.
    timer: threading.Timer | None = field(default=None, repr=False)
    #: Started actors that never ran a call, for the next call of its shape that places (spares.py).
    spare: bool = False


class SessionBusy(Exception):
    """A call of a session whose world cannot take it (it runs a call, or is another world)."""


def _check_session(world: HotWorld, request: p.JobRequest) -> None:
    shape = world.key.split("/", 1)[1]
    asked = world_key(request).split("/", 1)[1]
    if world.busy or shape != asked:
        nodes = len({pl.node_id for pl in world.places})
        raise SessionBusy(
            f"session {world.session!r} holds {len(world.actors)} rank(s) on {nodes} node(s)"
            + (" and is running a call" if world.busy else "")
            + f"; end it with %distributed_session --end {world.session} to start another world under that name"
        )


def world_key(request: p.JobRequest) -> str:
    """What a call must share with a hot world to run in it."""
    return f"{request.world_key}/{request.num_nodes}x{request.world_size // request.num_nodes}/{request.use_gpu}"


class HotWorlds:
    """The hot worlds of this notebook, idle or running a call (thread-safe)."""

    def __init__(self) -> None:
        self._worlds: list[HotWorld] = []
        self._lock = threading.Lock()
        #: (session, why) of each session world that ended outside a call, oldest first (`ended_sessions`).
        self._session_ends: list[tuple[str, str]] = []

    def take_hot(self, request: p.JobRequest) -> HotWorld | None:
        """An idle hot world of this call's world (or its session's), now busy; None if there is none.

        A session whose world runs a call, or holds another number of ranks or nodes, is a `SessionBusy`.
        """
        if not request.keep_alive:
            return None
        key = world_key(request)
        with self._lock:
            if request.session is not None:
                world = next((w for w in self._worlds if w.session == request.session), None)
                if world is not None:
                    _check_session(world, request)
            else:
                world = next(
                    (w for w in self._worlds if not w.busy and w.key == key and w.session is None and not w.spare), None
                )
            if world is not None:
                world.busy = True
                if world.timer is not None:
                    world.timer.cancel()
            return world

    def keep(self, world: HotWorld) -> None:
        """A call in `world` is over and every rank succeeded (or a spare set was asked for): it waits
        `keep_alive` s for the next call."""
        with self._lock:
            if world not in self._worlds:
                self._worlds.append(world)
            world.busy = False
            world.timer = threading.Timer(world.keep_alive, self._expire, args=(world,))
            world.timer.daemon = True
            world.timer.start()

    def take_spare(self, key: str) -> HotWorld | None:
        """The spare set of shape `key`, no longer kept here (the call that takes it ends it); None if there is none."""
        with self._lock:
            spare = next((w for w in self._worlds if w.spare and w.key == key), None)
            if spare is not None:
                self._worlds.remove(spare)
                if spare.timer is not None:
                    spare.timer.cancel()
            return spare

    def _expire(self, world: HotWorld) -> None:
        """Idle `keep_alive` s (this runs in the world's timer thread): end it, unless a call took it meanwhile."""
        with self._lock:
            if world.busy or world not in self._worlds or world.timer is not threading.current_thread():
                return  # taken by a call meanwhile, or already ended
            self._worlds.remove(world)
            self._ended([world], f"idle for {world.keep_alive:g} s (its keep-alive)")
        self._end([world])

    def _ended(self, worlds: list[HotWorld], why: str) -> None:
        """Keep (session, why) of the session worlds among `worlds`, ending outside a call (hold the lock)."""
        self._session_ends += [(w.session, why) for w in worlds if w.session is not None]

    def session_lost(self, name: str, why: str) -> None:
        """Session `name`'s world was found lost when a call came; that call starts another."""
        with self._lock:
            self._session_ends.append((name, why))

    def ended_sessions(self) -> list[tuple[str, str]]:
        """(session, why) for each session world that ended outside a call since last asked."""
        with self._lock:
            ends, self._session_ends = self._session_ends, []
        return ends

    def end_idle_session(self, name: str, why: str) -> bool:
        """End session `name`'s world now if it is idle; False if it runs a call (or there is none)."""
        with self._lock:
            world = next((w for w in self._worlds if w.session == name and not w.busy), None)
            if world is None:
                return False
            self._worlds.remove(world)
        with contextlib.suppress(Exception):
            self._end([world])
        return True

    def drop(self, world: HotWorld) -> None:
        """`world` is ending (its call failed, was stopped, or lost a rank): no call may take it."""
        with self._lock:
            if world in self._worlds:
                self._worlds.remove(world)
            if world.timer is not None:
                world.timer.cancel()

    def _end(self, worlds: list[HotWorld]) -> None:
        if not worlds:
            return
        ray = require_connected()
        for world in worlds:
            if world.timer is not None:
                world.timer.cancel()
            end_actors(ray, world.actors, world.pg, 3.0, ran=not world.spare)

    def hot_worlds(self) -> list[HotWorld]:
        """The hot worlds kept now, idle or running a call."""
        with self._lock:
            return [w for w in self._worlds if not w.spare]

    def spare_sets(self) -> list[HotWorld]:
        """The spare actor sets kept now (spares.py)."""
        with self._lock:
            return [w for w in self._worlds if w.spare]

    def holding(self) -> bool:
        """Hot worlds or spares are kept now (they may hold what a call waiting for resources needs)."""
        with self._lock:
            return bool(self._worlds)

    def release_spares(self) -> None:
        """End every spare set now (ray_init(spares=False))."""
        with self._lock:
            spares = [w for w in self._worlds if w.spare]
            for spare in spares:
                self._worlds.remove(spare)
        with contextlib.suppress(Exception):
            self._end(spares)

    def release_hot(self, sessions: bool = True) -> None:
        """End every idle hot world and spare set now: actors and placement group (a running call's ranks end with it).

        `sessions=False` leaves the sessions' worlds (a call waiting for resources ends only plain hot ranks).
        """
        with self._lock:
            idle = [w for w in self._worlds if not w.busy and (sessions or w.session is None)]
            for world in idle:
                self._worlds.remove(world)
            self._ended(idle, "%distributed_release ended every hot rank")
        with contextlib.suppress(Exception):  # a notebook no longer connected holds nothing
            self._end(idle)

    def idle_sessions(self) -> list[HotWorld]:
        """The sessions' worlds that wait for a call now."""
        with self._lock:
            return [w for w in self._worlds if w.session is not None and not w.busy]

    def end_all(self) -> None:
        """End every hot world, a call's or not (at shutdown)."""
        with self._lock:
            worlds, self._worlds = self._worlds, []
        with contextlib.suppress(Exception):
            self._end(worlds)
