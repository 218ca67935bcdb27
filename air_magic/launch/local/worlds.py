"""The local launcher's kept worlds, on the caller's side: which helper pool a call runs in, and what it leaves.

A `LocalWorld` is the keeper's record (launch/keeper.py, one per process that makes calls) of a pool of hot
ranks in the helper: the pool's id, chosen here, and the helper client that holds it. The keeper decides; this
module turns its decisions into the helper's requests and reads the helper's reports into them:

- `take`: the world a call runs in (an idle one of its world or its session's, or a new id), named in its
  `LaunchJob`; a helper that lacks the id (it was replaced) starts new ranks under it;
- `CallWorld.exited` / `.gone`: what a call leaves (`Keeper.keeps`, from each `RankExited`'s `usable`), and
  an idle world waits for its keep-alive (`Keeper.done`);
- `LocalWorld.end`: `EndPool` to the helper; `pool_ended`: the helper's own `PoolEnded`, said for a session.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...errors import AirMagicError
from .. import protocol as p
from ..keeper import Keeper, World, unusable


@dataclass(eq=False)
class LocalWorld(World):
    """A helper's pool of hot ranks, as the caller's keeper holds it."""

    #: The pool's id in the helper (LaunchJob.pool, EndPool.pool, PoolEnded.pool).
    pool: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    #: The helper client that holds it (launcher.SupervisorClient); None while it moves to another helper.
    client: Any = None
    #: Where a call running in it says a session's end (its event queue): set while a call runs in it.
    tell: Callable[[p.Event], None] | None = None
    #: The helper ended it itself (PoolEnded): nothing to ask of it.
    ended_by_helper: bool = False

    def end(self, why: str) -> None:
        client = self.client
        if self.ended_by_helper or client is None or not client.alive:
            return  # the helper's ranks end with it
        try:
            client.send(p.EndPool(self.pool, why))
        except AirMagicError:
            pass  # the helper is gone, and its pools with it

    def said(self, why: str) -> None:
        if self.tell is not None:
            self.tell(p.SessionEnded(self.call, self.session or "", why))


def take(
    keeper: Keeper, request: p.JobRequest, client: Any, tell: Callable[[p.Event], None], call_id: str = ""
) -> LocalWorld | None:
    """The kept world `request` runs in, busy with it (a new one if none is kept); None for a call that keeps none.

    A session whose world is busy or of another shape is the keeper's `SessionBusy`.
    """
    if not request.keep_alive:
        return None
    shape = str(request.world_size)
    world = keeper.take(request.world_key, shape, request.job_id, request.session, kind=LocalWorld, call_id=call_id)
    if world is None:
        world = LocalWorld(
            request.world_key,
            shape,
            float(request.keep_alive),
            request.session,
            call=request.job_id,
            call_id=call_id,
            client=client,
        )
        keeper.add(world)
    world.client, world.tell = client, tell
    return world


class CallWorld:
    """What one call's exits leave of its world: the keeper's `keeps`, from what the helper reports."""

    def __init__(self, keeper: Keeper, world: LocalWorld | None, world_size: int) -> None:
        self.keeper, self.world, self.world_size = keeper, world, world_size
        self.exits: dict[int, tuple[int, bool]] = {}  # rank -> (exit code, usable)
        self.failed = False

    def exited(self, event: p.RankExited) -> None:
        """A rank's call is over: a rank that leaves its process unfit ends the world now (the next call gets fresh
        ranks)."""
        self.exits.setdefault(event.rank, (event.returncode, event.usable))
        world = self.world
        if world is not None and not Keeper.keeps(world, event.returncode == 0, event.usable):
            self.keeper.release(world, unusable(event.rank))

    def gone(self) -> None:
        """Every process of the call is gone: its world, if still kept and left usable, waits for the next call."""
        world, self.world = self.world, None
        if world is None or world not in self.keeper.worlds(LocalWorld):
            return
        world.tell = None
        finished = not self.failed and len(self.exits) == self.world_size
        clean = finished and all(code == 0 for code, _ in self.exits.values())
        usable = finished and all(ok for _, ok in self.exits.values())
        if Keeper.keeps(world, clean, usable):
            self.keeper.done(world)
        else:  # it never ran (the launch failed): nothing was said of it
            self.keeper.release(world, "its call did not start", say=False)

    def lost(self) -> None:
        """The helper died: the world's ranks went with it (the runner says so for a session)."""
        world, self.world = self.world, None
        if world is not None:
            world.tell = None
            self.keeper.drop(world)


def pool_ended(keeper: Keeper, client: Any, event: p.PoolEnded) -> None:
    """The helper ended a pool by itself: release its world, saying why for a session (to its call, if one runs)."""
    for world in keeper.worlds(LocalWorld):
        if world.pool == event.pool and world.client is client:
            world.ended_by_helper = True
            keeper.release(world, event.why)


def moved(keeper: Keeper, old: Any, new: Any, world: LocalWorld | None) -> None:
    """The helper `old` is replaced by `new`: its idle worlds end (said for a session); `world`, the call's own,
    moves to `new`, which starts new ranks under its id."""
    if world is not None:
        world.client = None  # a PoolEnded of `old` no longer finds it
    keeper.release_where(
        lambda w: isinstance(w, LocalWorld) and w.client is old and not w.busy, "the helper was replaced"
    )
    if world is not None:
        world.client = new
