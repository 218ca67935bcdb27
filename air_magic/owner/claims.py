"""A call's claim on the owner's ledger: take its GPUs or CPU slots now or wait in line, run with them, then hand
them to the world the call leaves kept, or give them back.

A call on several nodes (Ray) places its ranks there, not here: it claims nothing. A call may borrow what an idle
kept world of this process holds (`borrowable`): a session's call its session's units, any call the units of idle
hot ranks (it runs in them, or beside them as it always has), and a CPU call the slots of this process's idle
sessions. What another process holds, it never takes: it waits, and says for what. Not for: counting units
(calls/ledger.py) or locking them machine-wide (calls/leases.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..calls.ledger import Holder, Ledger, kind_of

#: Seconds between two asks of a waiting call to other processes' idle hot ranks.
ASK_EVERY = 1.0
from ..job import JobSpec
from ..launch.keeper import World


def borrowable(spec: JobSpec) -> Callable[[Holder], int]:
    """Which holders of this process `spec`'s call may borrow from, most wanted first (a higher number)."""

    def pick(holder: Holder) -> int:
        if not isinstance(holder, World) or holder.busy:
            return 0
        if spec.session is not None and holder.session == spec.session:
            return 3  # its own session's ranks, on their own GPUs
        if holder.session is None:
            return 2  # idle hot ranks: the call runs in them, or beside them
        return 1 if not spec.uses_gpu else 0  # another session's idle CPU slots, never its GPUs

    return pick


def world_label(world: World, label: str) -> str:
    """How a lease file and a waiting call name the units a kept world holds."""
    what = f"session {world.session!r}" if world.session is not None else "idle hot ranks"
    return f"{what} kept by {label}"


class Claim:
    """One call's use of the ledger: try now, or wait in line; then run with its units; then keep or give back.

    `holder` is the call's id ("call <run directory's name>"), which the lease files name.
    """

    def __init__(self, ledger: Ledger | None, spec: JobSpec, holder: str, label: str) -> None:
        self.spec = spec
        self.holder: Holder = holder
        #: How the call is named ("call <id> (train)"); `label`, as its units are named while it runs.
        self.call_label = label
        self.label = label if spec.session is None else f"session {spec.session!r} ({label})"
        self.ledger = ledger if spec.num_nodes == 1 else None
        self.units: tuple[str, ...] | None = None
        self._asked = float("-inf")
        if self.ledger is not None:
            self.ledger.check(spec.world_size, kind_of(spec))

    def try_now(self) -> bool:
        if self.ledger is None:
            return True
        self.units = self.ledger.take(
            self.holder, self.spec.world_size, kind_of(self.spec), self.label, borrow=borrowable(self.spec)
        )
        return self.units is not None

    def why_waiting(self) -> str:
        return self.ledger.why_waiting(self.spec.world_size, kind_of(self.spec)) if self.ledger is not None else ""

    def wait(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        if self.ledger is not None and self.units is None:
            self.units = self.ledger.wait_take(
                self.holder,
                self.spec.world_size,
                kind_of(self.spec),
                self.label,
                cancelled,
                borrow=borrowable(self.spec),
                tick=self._ask_idle_hot_ranks,
            )

    def _ask_idle_hot_ranks(self) -> None:
        """While it waits, at most once a second: ask each other process whose idle hot ranks hold what it needs to
        end them (never a session's: those wait for their own end)."""
        now = time.monotonic()
        if self.ledger is None or self.ledger.leases is None or now - self._asked < ASK_EVERY:
            return
        self._asked = now
        for pid in self.ledger.yielding_elsewhere(kind_of(self.spec)):
            self.ledger.leases.ask_to_yield(pid, f"{self.call_label} (pid {os.getpid()})")

    def keep_in(self, world: World) -> bool:
        """The call left `world` kept: the units it took go to the world, for as long as its ranks live."""
        if self.ledger is None:
            return False
        label = world_label(world, self.call_label)
        return self.ledger.hand_over(self.holder, world, label, yields=world.session is None)

    def release(self) -> None:
        """What the call holds goes back: its own units free, what it borrowed to its lender."""
        if self.ledger is not None:
            self.ledger.give_back(self.holder)

    def apply(self, spec: JobSpec) -> JobSpec:
        """`spec` with its GPUs as CUDA_VISIBLE_DEVICES (a CPU call is unchanged)."""
        if self.ledger is None or not spec.uses_gpu or not self.units or "CUDA_VISIBLE_DEVICES" in spec.extra_env:
            return spec
        return dataclasses.replace(spec, extra_env={**spec.extra_env, "CUDA_VISIBLE_DEVICES": ",".join(self.units)})

    @contextmanager
    def held(
        self,
        spec: JobSpec,
        on_wait: Callable[[str], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[JobSpec]:
        """Hold the call's units while the block runs (waiting for them first, if need be, until `cancelled()`);
        given back after, unless the block kept them in a world."""
        if self.units is None and not self.try_now():
            if on_wait is not None:
                on_wait(self.why_waiting())
            self.wait(cancelled)
        try:
            yield self.apply(spec)
        finally:
            self.release()
