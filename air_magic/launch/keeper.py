"""The keeper of kept worlds: ranks that outlive a call, and the one place their rules are written.

A kept world is the ranks of a call that stay alive after it, in one of three kinds:

- hot (`keep_alive`): the next call of the same world (same key and shape) runs in them;
- session (`--session NAME`): found by its name, not its world; a call of the session runs in it
  whatever its environment, and an error in user code keeps it;
- spare (Ray): started ahead of the next cold call of a shape, never ran user code; only a call that
  places takes it (`take_spare`).

The rules, written once here and adapted by each launcher (the helper's pools,
launch/local/pool.py, for processes and pipes; Ray's hot worlds, launch/ray/hot.py, for
actors and placement groups), as torch elastic's agent holds the policy its local agent
carries out:

- who may take a world: a plain call takes an idle hot world of its key and shape, never a
  session's or a spare; a session call takes its session's world, which must be idle and of its
  shape, else `SessionBusy` says what holds the name and how to end it;
- what a call leaves: a world whose call every rank finished stays; a session's stays also when
  each rank that raised came back usable (`keeps`); anything else ends;
- what ends a world: idle `keep_alive` s (`expire`), a failed or stopped call, a lost rank, a
  release (sessions spared where asked), the kernel's end; the reason is said once, for a
  session's world, through `said`;
- what a world holds (`World.holds`: GPUs or CPU worker slots), so that one ledger can count
  what kept worlds and running calls hold.

Thread-safe: Ray's worlds are kept by the notebook's threads and timers; the helper's by its
single loop. This module imports nothing of either launcher.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

# -- the reasons said for a world's end, written once for both launchers and the notebook ----------------------
#: %distributed_release (or a call waiting for resources) ended the idle worlds.
RELEASED = "%distributed_release ended every hot rank"
#: The reason a world ends when its call's ranks were stopped (Cancel, the timeout, a failed rank, ...).
STOPPED = "its ranks were stopped"


def stopped(reason: str) -> str:
    """STOPPED with the stop's reason, such as "(cancelled)": a world ended by a stop."""
    return f"{STOPPED} ({reason})"


def unusable(rank: int) -> str:
    """A world ended because a rank's error left its process unfit for the next call."""
    return f"rank {rank} raised an error that leaves it unusable"


class SessionBusy(RuntimeError):
    """A call of a session whose world cannot take it: it runs a call, or holds another shape."""


@dataclass(eq=False)
class World:
    """What the keeper knows of one kept world; each launcher extends it with its own handles."""

    #: What a call must share with it to run in it (interpreter, environment, accelerator type, ...).
    key: str
    #: The ranks' layout a call must match, e.g. "2" or "2x4/True" (nodes x ranks per node / GPU).
    shape: str
    keep_alive: float
    #: The session it holds, if any.
    session: str | None = None
    #: Started ahead of a call of its shape; never ran user code.
    spare: bool = False
    #: The call that runs in it now, or "" while it waits.
    call: str = ""
    idle_since: float | None = None
    #: Counts the calls taken: a timer armed for an idle world ends it only if no call took it since.
    generation: int = 0
    #: What it holds for the ledger: ("gpu", index) or ("cpu", slot) per rank.
    holds: tuple[tuple[str, int], ...] = ()

    @property
    def busy(self) -> bool:
        return bool(self.call)

    def describe(self) -> str:
        """How a refusal names it, e.g. "2 rank(s)"."""
        return f"{self.shape} rank(s)"


W = TypeVar("W", bound=World)


class Keeper(Generic[W]):
    """The kept worlds of one launcher and the rules above; `end` carries an end out, `said` tells of a session's."""

    def __init__(
        self,
        end: Callable[[list[W]], None],
        said: Callable[[W, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._worlds: list[W] = []
        self._lock = threading.RLock()
        self._end = end
        self._said = said
        self._clock = clock

    # -- who may take a world ------------------------------------------------
    def take(self, key: str, shape: str, call: str, session: str | None = None) -> W | None:
        """The world this call runs in, now busy with it; None if it must start its own ranks.

        A session's world that runs a call or holds another shape is a `SessionBusy`.
        """
        with self._lock:
            if session is not None:
                world = self.session(session)
                if world is not None and (world.busy or world.shape != shape):
                    raise SessionBusy(
                        f"session {session!r} holds {world.describe()}"
                        + (" and is running a call" if world.busy else "")
                        + f"; end it with %distributed_session --end {session} to start another world under that name"
                    )
            else:
                world = next(
                    (
                        w
                        for w in self._worlds
                        if not w.busy and not w.spare and w.session is None and w.key == key and w.shape == shape
                    ),
                    None,
                )
            if world is not None:
                world.call, world.idle_since = call, None
                world.generation += 1
            return world

    def take_spare(self, key: str) -> W | None:
        """The spare set of `key`, no longer kept (the call that takes it owns it now); None if there is none."""
        with self._lock:
            spare = next((w for w in self._worlds if w.spare and w.key == key), None)
            if spare is not None:
                self._worlds.remove(spare)
            return spare

    # -- what a call leaves -----------------------------------------------------
    def add(self, world: W) -> None:
        """Keep `world`: a call's new ranks (busy with it) or a spare set (idle)."""
        with self._lock:
            if world not in self._worlds:
                self._worlds.append(world)
            if not world.busy and world.idle_since is None:
                world.idle_since = self._clock()

    def done(self, world: W) -> int:
        """The call in `world` is over and left it usable: it waits `keep_alive` s. Returns its generation."""
        with self._lock:
            if world not in self._worlds:
                self._worlds.append(world)
            world.call, world.idle_since = "", self._clock()
            return world.generation

    @staticmethod
    def keeps(world: World | None, clean: bool, usable: bool) -> bool:
        """A call's world stays when the call was `clean` (every rank finished); a session's also when every
        rank that raised came back `usable`."""
        return world is not None and (clean or (world.session is not None and usable))

    # -- what ends a world ------------------------------------------------------
    def release(self, world: W, why: str, say: bool = True) -> bool:
        """End `world` now (its call, if any, ends as stopped); False if it was not kept."""
        with self._lock:
            if world not in self._worlds:
                return False
            self._worlds.remove(world)
        if say and world.session is not None and self._said is not None:
            self._said(world, why)
        self._end([world])
        return True

    def drop(self, world: W) -> None:
        """`world` is ending by its call's hand (failed, stopped, lost a rank): no call may take it."""
        with self._lock:
            if world in self._worlds:
                self._worlds.remove(world)

    def release_where(self, pick: Callable[[W], bool], why: str, say: bool = True) -> list[W]:
        """End every kept world `pick` chooses; the ones ended."""
        with self._lock:
            chosen = [w for w in self._worlds if pick(w)]
        return [w for w in chosen if self.release(w, why, say)]

    def release_idle(self, why: str, sessions: bool = True) -> list[W]:
        """End every idle world (spares included); `sessions=False` spares the sessions' worlds."""
        return self.release_where(lambda w: not w.busy and (sessions or w.session is None), why)

    def expire(self, now: float | None = None) -> list[W]:
        """End each world idle for its `keep_alive` s."""
        now = self._clock() if now is None else now
        with self._lock:
            idle = [
                w
                for w in self._worlds
                if not w.busy and now - (w.idle_since if w.idle_since is not None else now) >= w.keep_alive
            ]
        return [w for w in idle if self.release(w, self.idle_reason(w))]

    def expire_one(self, world: W, generation: int) -> bool:
        """End `world` after its keep-alive, unless a call took it since `generation` (a timer's end)."""
        with self._lock:
            if world.busy or world.generation != generation or world not in self._worlds:
                return False
        return self.release(world, self.idle_reason(world))

    @staticmethod
    def idle_reason(world: World) -> str:
        return f"idle for {world.keep_alive:g} s (its keep-alive)"

    def end_all(self, why: str, say: bool = True) -> list[W]:
        """End every kept world, a call's or not (the kernel's end)."""
        return self.release_where(lambda w: True, why, say)

    # -- what is kept -----------------------------------------------------------
    def session(self, name: str) -> W | None:
        """The world that holds session `name`, if it is kept."""
        with self._lock:
            return next((w for w in self._worlds if w.session == name), None)

    def worlds(self) -> list[W]:
        """Every kept world, idle or running a call."""
        with self._lock:
            return list(self._worlds)

    def holds(self) -> list[tuple[str, int]]:
        """What every kept world holds (GPUs, CPU slots), for the ledger."""
        with self._lock:
            return [held for w in self._worlds for held in w.holds]
