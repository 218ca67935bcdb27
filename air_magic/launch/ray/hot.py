"""Hot worlds on Ray: actors kept between calls, adapted to the keeper of kept worlds (launch/keeper.py).

After a call in which every rank succeeded, its actors, their placement group,
what they imported and their default process group stay as a `HotWorld`; the
next call of the same world (`world_key`, node count, ranks per node, GPU or
not) runs in them, with the first call's MASTER_ADDR and MASTER_PORT. A
session's world is found by its name; spare actor sets (spares.py, `spare`)
wait beside them for a call that places. Which call takes a world, what a call
leaves and what ends one (its keep-alive's timer included) are the rules of the
one keeper of this process (its owner's), which the local launcher shares; this
module carries them out with Ray: `placement.end_actors` for an end.
Ray-only rule kept here: a call of another world that waits for resources ends
idle hot worlds and spares, not sessions (starting.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

from .. import protocol as p
from ..keeper import RELEASED, Keeper, World
from .cluster import require_connected
from .placement import end_actors


class HotWorld(World):
    """Actors kept between calls of one world: their placement group, where they run, where their group meets."""

    def __init__(
        self,
        key: str,
        actors: list[Any],
        pg: Any,
        places: list[p.ActorPlace],
        master: str,
        port: int,
        keep_alive: float,
        session: str | None = None,
        busy: bool = True,
        spare: bool = False,
    ) -> None:
        super().__init__(
            key, key.split("/", 1)[-1], keep_alive, session=session, spare=spare, call="a call" if busy else ""
        )
        self.actors, self.pg, self.places, self.master, self.port = actors, pg, places, master, port

    def describe(self) -> str:
        nodes = len({pl.node_id for pl in self.places})
        return f"{len(self.actors)} rank(s) on {nodes} node(s)"

    def end(self, why: str) -> None:
        """Its actors and placement group end (a notebook no longer connected holds nothing)."""
        with contextlib.suppress(Exception):
            end_actors(require_connected(), self.actors, self.pg, 3.0, ran=not self.spare)


def world_key(request: p.JobRequest) -> str:
    """What a call must share with a hot world to run in it."""
    return f"{request.world_key}/{request.num_nodes}x{request.world_size // request.num_nodes}/{request.use_gpu}"


class HotWorlds:
    """The hot worlds of this notebook, idle or running a call: Ray's view of the process's keeper."""

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper

    def take_hot(self, request: p.JobRequest) -> HotWorld | None:
        """An idle hot world of this call's world (or its session's), now busy; None if there is none.

        A session whose world runs a call, or holds another number of ranks or nodes, is a `SessionBusy`.
        """
        if not request.keep_alive:
            return None
        key = world_key(request)
        return self.keeper.take(key, key.split("/", 1)[-1], request.job_id, request.session, kind=HotWorld)

    def keep(self, world: HotWorld) -> None:
        """A call in `world` is over and every rank succeeded (or a spare set was asked for): it waits
        `keep_alive` s for the next call."""
        self.keeper.done(world)

    def take_spare(self, key: str) -> HotWorld | None:
        """The spare set of shape `key`, no longer kept here (the call that takes it ends it); None if there is none."""
        return self.keeper.take_spare(key, kind=HotWorld)

    def session_lost(self, world: HotWorld, why: str) -> None:
        """A session's `world` was found lost when a call came; that call starts another."""
        self.keeper.session_ended(world, why)

    def end_idle_session(self, name: str, why: str) -> bool:
        """End session `name`'s world now if it is idle; False if it runs a call (or there is none)."""
        world = self.keeper.session(name, kind=HotWorld)
        if world is None or world.busy:
            return False
        return self.keeper.release(world, why, say=False)

    def drop(self, world: HotWorld) -> None:
        """`world` is ending (its call failed, was stopped, or lost a rank): no call may take it."""
        self.keeper.drop(world)

    def hot_worlds(self) -> list[HotWorld]:
        """The hot worlds kept now, idle or running a call."""
        return [w for w in self.keeper.worlds(HotWorld) if not w.spare]

    def spare_sets(self) -> list[HotWorld]:
        """The spare actor sets kept now (spares.py)."""
        return [w for w in self.keeper.worlds(HotWorld) if w.spare]

    def holding(self) -> bool:
        """Hot worlds or spares are kept now (they may hold what a call waiting for resources needs)."""
        return bool(self.keeper.worlds(HotWorld))

    def release_spares(self) -> None:
        """End every spare set now (ray_init(spares=False))."""
        self.keeper.release_where(lambda w: isinstance(w, HotWorld) and w.spare, "spares were turned off", say=False)

    def release_hot(self, sessions: bool = True) -> None:
        """End every idle hot world and spare set now: actors and placement group (a running call's ranks end with it).

        `sessions=False` leaves the sessions' worlds (a call waiting for resources ends only plain hot ranks).
        """
        self.keeper.release_idle(RELEASED, sessions=sessions, kind=HotWorld)

    def idle_sessions(self) -> list[HotWorld]:
        """The sessions' worlds that wait for a call now."""
        return [w for w in self.keeper.worlds(HotWorld) if w.session is not None and not w.busy]

    def end_all(self) -> None:
        """End every hot world, a call's or not (at shutdown)."""
        self.keeper.end_all("the notebook shut Ray down", say=False, kind=HotWorld)
