"""The keeper of kept worlds: ranks that outlive a call, and the one place their rules are written.

A kept world is the ranks of a call that stay alive after it, in one of three kinds:

- hot (`keep_alive`): the next call of the same world (same key and shape) runs in them;
- session (`--session NAME`): found by its name, not its world; a call of the session runs in it
  whatever its environment, and an error in user code keeps it;
- spare (Ray): started ahead of the next cold call of a shape, never ran user code; only a call that
  places takes it (`take_spare`).

One keeper per process that makes calls (the owner's, air_magic/owner/: the notebook's kernel, a command-line
process, a detached call's owner), handed to both launchers, as torch elastic's agent holds the policy its local
agent carries out.
Each launcher's `World` subclass carries an end out (`World.end`: the local helper's pool, launch/local/worlds.py,
ended by an `EndPool` request; Ray's actors and placement group, launch/ray/hot.py); the helper only runs and
reports. The rules:

- who may take a world: a plain call takes an idle hot world of its key and shape, never a
  session's or a spare; a session call takes its session's world, which must be idle and of its
  shape, else `SessionBusy` says what holds the name and how to end it;
- what a call leaves: a world whose call every rank finished stays; a session's stays also when
  each rank that raised came back usable (`keeps`, used by both launchers); anything else ends;
- what ends a world: idle `keep_alive` s (one timer per idle world, or `expire` with a clock), a failed or
  stopped call, a lost rank, a release (sessions spared where asked), the kernel's end; the reason is said once
  for a session's world: to its running call (`World.said`), or, idle, in `ended_sessions`.

What else the calling side knows of a session's world (its ranks' pids, hosts, the names they hold) rides on the
world itself (`World.record`, calls/sessions.py), so a session lives exactly as long as its kept world. The GPUs or
CPU slots a kept world holds are counted by the owner's machine-wide ledger: the call that made it hands its units to
the world (`World.call_id` names that call), and the keeper tells the owner (`on_end`) the moment it lets a world go,
so its units are free again at once.

Thread-safe: worlds are kept by the notebook's threads, the helper's event reader and timers. This module imports
nothing of either launcher.

Over 300 lines because every rule of a kept world (take, leave, end, hand its units to its owner) is written once,
here, for both launchers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    """What the keeper knows of one kept world; each launcher extends it with its own handles and its `end`."""

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
    #: The id of the last call that ran in it (its run directory's name): the owner hands that call's GPUs or CPU
    #: slots to the world when the call leaves it kept.
    call_id: str = ""
    #: When it ended (wall clock), once it has.
    ended_at: float | None = None
    idle_since: float | None = None
    #: Counts the calls taken: a timer armed for an idle world ends it only if no call took it since.
    generation: int = 0
    #: The calling side's record of a session's world (calls/sessions.Record: pids, hosts, the names its ranks
    #: hold); None until a call of the session has finished in it.
    record: Any = field(default=None, repr=False)
    #: Ends it once it has been idle `keep_alive` s (armed by `Keeper.done`).
    timer: threading.Timer | None = field(default=None, repr=False)

    @property
    def busy(self) -> bool:
        return bool(self.call)

    def describe(self) -> str:
        """How a refusal names it, e.g. "2 rank(s)"."""
        return f"{self.shape} rank(s)"

    def end(self, why: str) -> None:
        """Carry the end out (the launcher's part: stop processes, end actors); the keeper no longer holds it."""

    def said(self, why: str) -> None:
        """A session's world ended while a call runs in it: that call says `why` (its launcher's SessionEnded)."""


W = TypeVar("W", bound=World)


class Keeper:
    """The kept worlds of this process, both launchers', and the rules above."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        timers: bool = True,
        on_end: Callable[[World], None] | None = None,
    ) -> None:
        self._worlds: list[World] = []
        #: Told of each world the moment the keeper lets go of it (the owner gives its units back then).
        self._on_end = on_end
        self._lock = threading.RLock()
        self._clock = clock
        #: Arm a timer per idle world (off: only `expire` ends idle worlds, as unit tests drive it).
        self._timers = timers
        #: (world, why) of each session's world that ended outside a call, oldest first (`ended_sessions`).
        self._session_ends: list[tuple[World, str]] = []

    # -- who may take a world ------------------------------------------------
    def take(
        self,
        key: str,
        shape: str,
        call: str,
        session: str | None = None,
        kind: type[W] = World,  # type: ignore[assignment]
        call_id: str = "",
    ) -> W | None:
        """The world of `kind` this call runs in, now busy with it; None if it must start its own ranks.

        A session's world that runs a call or holds another shape is a `SessionBusy`.
        """
        with self._lock:
            world: W | None
            if session is not None:
                world = self.session(session, kind)
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
                        for w in self.worlds(kind)
                        if not w.busy and not w.spare and w.session is None and w.key == key and w.shape == shape
                    ),
                    None,
                )
            if world is not None:
                world.call, world.idle_since = call, None
                world.call_id = call_id or world.call_id
                world.generation += 1
                _cancel(world)
            return world

    def take_spare(self, key: str, kind: type[W] = World) -> W | None:  # type: ignore[assignment]
        """The spare set of `key`, no longer kept (the call that takes it owns it now); None if there is none."""
        with self._lock:
            spare = next((w for w in self.worlds(kind) if w.spare and w.key == key), None)
            if spare is not None:
                self._worlds.remove(spare)
                _cancel(spare)
                self._ended(spare)
            return spare

    # -- what a call leaves -----------------------------------------------------
    def add(self, world: World) -> None:
        """Keep `world`: a call's new ranks (busy with it) or a spare set (idle)."""
        with self._lock:
            if world not in self._worlds:
                self._worlds.append(world)
            if not world.busy and world.idle_since is None:
                world.idle_since = self._clock()

    def done(self, world: World) -> int:
        """The call in `world` is over and left it usable: it waits `keep_alive` s (a timer ends it then, unless a
        call takes it). Returns its generation."""
        with self._lock:
            if world not in self._worlds:
                self._worlds.append(world)
            world.call, world.idle_since = "", self._clock()
            generation = world.generation
            _cancel(world)
            if self._timers:
                world.timer = threading.Timer(world.keep_alive, self.expire_one, args=(world, generation))
                world.timer.daemon = True
                world.timer.start()
            return generation

    @staticmethod
    def keeps(world: World | None, clean: bool, usable: bool) -> bool:
        """A call's world stays when the call was `clean` (every rank finished); a session's also when every
        rank that raised came back `usable`."""
        return world is not None and (clean or (world.session is not None and usable))

    def left_by(self, call_id: str, hand: Callable[[World], bool]) -> bool:
        """`hand(world)` for each world kept now whose last call was `call_id`, under the lock (so a world is
        never handed what it cannot give back: its end waits); whether one took it."""
        with self._lock:
            taken = [hand(w) for w in self._worlds if call_id and w.call_id == call_id]
            return any(taken)

    # -- what ends a world ------------------------------------------------------
    def release(self, world: World, why: str, say: bool = True) -> bool:
        """End `world` now (its call, if any, ends as stopped); False if it was not kept."""
        return self._release_if(world, why, say, lambda: True)

    def _release_if(self, world: World, why: str, say: bool, still: Callable[[], bool]) -> bool:
        """`release`, if `world` is kept and `still()` holds, both read under the lock (the end runs outside it)."""
        with self._lock:
            if world not in self._worlds or not still():
                return False
            self._worlds.remove(world)
            _cancel(world)
            world.ended_at = time.time()
            busy = world.busy
            if say and world.session is not None and not busy:
                self._session_ends.append((world, why))
            self._ended(world)
        if say and world.session is not None and busy:
            world.said(why)
        world.end(why)
        return True

    def drop(self, world: World) -> None:
        """`world` is ending by its call's hand (failed, stopped, lost a rank): no call may take it."""
        with self._lock:
            if world in self._worlds:
                self._worlds.remove(world)
                world.ended_at = time.time()
                self._ended(world)
            _cancel(world)

    def _ended(self, world: World) -> None:
        """Under the lock: the keeper no longer holds `world`; its owner is told at once (its units go back)."""
        if self._on_end is not None:
            self._on_end(world)

    def release_where(self, pick: Callable[[World], bool], why: str, say: bool = True) -> list[World]:
        """End every kept world `pick` chooses; the ones ended."""
        with self._lock:
            chosen = [w for w in self._worlds if pick(w)]
        return [w for w in chosen if self.release(w, why, say)]

    def release_if_idle(self, pick: Callable[[World], bool], why: str) -> list[World]:
        """End every kept world `pick` chooses that is idle when its end comes (a world a call takes meanwhile
        stays); the ones ended."""
        with self._lock:
            chosen = [w for w in self._worlds if pick(w)]
        return [w for w in chosen if self._release_if(w, why, True, lambda w=w: not w.busy)]  # type: ignore[misc]

    def release_idle(self, why: str, sessions: bool = True, kind: type[World] = World) -> list[World]:
        """End every idle world of `kind` (spares included); `sessions=False` spares the sessions' worlds."""
        return self.release_where(lambda w: isinstance(w, kind) and not w.busy and (sessions or w.session is None), why)

    def expire(self, now: float | None = None) -> list[World]:
        """End each world idle for its `keep_alive` s."""
        now = self._clock() if now is None else now
        with self._lock:
            idle = [
                w
                for w in self._worlds
                if not w.busy and now - (w.idle_since if w.idle_since is not None else now) >= w.keep_alive
            ]
        return [w for w in idle if self.release(w, self.idle_reason(w))]

    def expire_one(self, world: World, generation: int) -> bool:
        """End `world` after its keep-alive, unless a call took it since `generation` (a timer's end)."""
        return self._release_if(
            world, self.idle_reason(world), True, lambda: not world.busy and world.generation == generation
        )

    @staticmethod
    def idle_reason(world: World) -> str:
        return f"idle for {world.keep_alive:g} s (its keep-alive)"

    def end_all(self, why: str, say: bool = True, kind: type[World] = World) -> list[World]:
        """End every kept world of `kind`, a call's or not (the kernel's end)."""
        return self.release_where(lambda w: isinstance(w, kind), why, say)

    # -- sessions ended outside a call --------------------------------------------
    def session_ended(self, world: World, why: str) -> None:
        """A session's `world` was found ended outside a call (say, lost when a call came): said once."""
        with self._lock:
            self._session_ends.append((world, why))

    def ended_sessions(self) -> list[tuple[World, str]]:
        """(world, why) for each session's world that ended outside any call since last asked, oldest first."""
        with self._lock:
            ends, self._session_ends = self._session_ends, []
        return ends

    # -- what is kept -----------------------------------------------------------
    def session(self, name: str, kind: type[W] = World) -> W | None:  # type: ignore[assignment]
        """The world of `kind` that holds session `name`, if it is kept."""
        with self._lock:
            return next((w for w in self.worlds(kind) if w.session == name), None)

    def worlds(self, kind: type[W] = World) -> list[W]:  # type: ignore[assignment]
        """Every kept world of `kind`, idle or running a call."""
        with self._lock:
            return [w for w in self._worlds if isinstance(w, kind)]


def _cancel(world: World) -> None:
    if world.timer is not None:
        world.timer.cancel()
        world.timer = None
