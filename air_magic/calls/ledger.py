"""The ledger of this node's GPUs and CPU worker slots: who holds which (a call, or a kept world), and who waits.

Calls that run at once never share a GPU. Every call of the process on this node takes its units here before its
ranks start; a call that leaves a world kept (hot ranks, a session) hands its units to that world (`hand_over`),
which holds them until the owner gives them back at the world's end. A call may borrow units a kept world of this
process holds (`take(..., borrow=...)`: a session's call its session's, any call idle hot ranks'). A call whose
units are not free waits, first come first served, and can say what it waits for (`why_waiting`). The same rule
holds for CPU worker slots: there are `$AIR_MAGIC_CPU_SLOTS` of them (default: the machine's core count); a CPU call
asking for more slots than exist runs once every slot is free, as an oversubscribed call always has.

A ledger with leases (`machine_ledger()`, the owner's) is machine-wide: each unit it hands out is also leased
(leases.py) by a lock the OS frees when this process ends, so kernels, command-line runs and detached calls of this
user on the machine never share a unit, and a call waiting for one held elsewhere names that holder. The line of
waiting calls is this process's; between processes, the first to find units free takes them.

`Ledger` is a plain object (tests/unit/test_ledger.py). How a call uses it is its claim (owner/claims.py). Not for:
starting or stopping processes.

Over 300 lines because taking, borrowing, handing over and giving back units are one set of rules over one table
of holders and their leases.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ..envvars import CPU_SLOTS
from ..errors import ConfigurationError, JobCancelledError
from ..job import JobSpec
from .leases import Lease, Leases

GPU = "GPU"
CPU = "CPU"
#: Seconds between two looks at a waiting call's cancel flag.
_WAIT_STEP = 0.2


@dataclass(frozen=True)
class Hold:
    """What one holder has: its kind, the units (GPU ids or CPU slot numbers), and how it is named to users."""

    kind: str
    units: tuple[str, ...]
    label: str


#: Who holds units: a call (its key, such as "call 20261206-...-train-x1y2"), or a kept world (the keeper's `World`
#: object), which holds the units of the call that made it for as long as its ranks live.
Holder = Hashable


class Ledger:
    """GPUs and CPU slots of one node, and who holds them; thread-safe.

    A holder may *borrow* units another holder of this process has (`take(..., borrow=pick)`): a call running in a
    kept world, or beside an idle one, as the owner allows. Borrowed units take no second lease; they go back to
    their lender when the borrower gives back, and to the borrower when the lender gives back first.
    """

    def __init__(self, gpus: list[str], cpu_slots: int, leases: Leases | None = None) -> None:
        self.units = {GPU: list(gpus), CPU: [str(i) for i in range(max(1, cpu_slots))]}
        self._held: dict[Holder, Hold] = {}
        #: borrower -> lender -> the units borrowed from it.
        self._borrowed: dict[Holder, dict[Holder, tuple[str, ...]]] = {}
        #: Machine-wide: the lock files of this user's processes (None: this process alone, as in unit tests).
        self.leases = leases
        self._leased: dict[Holder, list[Lease]] = {}
        self._queue: list[Holder] = []  # holders waiting, oldest first
        self._changed = threading.Condition()

    def total(self, kind: str) -> int:
        return len(self.units[kind])

    def holders(self) -> dict[Holder, Hold]:
        with self._changed:
            return dict(self._held)

    def free(self, kind: str) -> list[str]:
        with self._changed:
            return self._free(kind)

    def _free(self, kind: str) -> list[str]:
        taken = {u for h in self._held.values() if h.kind == kind for u in h.units}
        return [u for u in self.units[kind] if u not in taken]

    def check(self, n: int, kind: str) -> None:
        """Refuse at once a GPU call that could never run here: more GPUs than the node has."""
        if kind == GPU and n > self.total(GPU):
            raise ConfigurationError(
                f"this call asks for {n} GPU(s) and this node has {self.total(GPU)}; ask for at most "
                f"{self.total(GPU)} (num_accelerators= or --gpus)."
            )

    def _lendable(self, kind: str, holder: Holder, borrow: Callable[[Holder], int] | None) -> dict[Holder, list[str]]:
        """lender -> its units that `holder` may borrow (units no one borrows already), the most wanted first."""
        if borrow is None:
            return {}
        lent = {u for loans in self._borrowed.values() for units in loans.values() for u in units}
        found = {}
        for other, hold in self._held.items():
            if other != holder and other not in self._borrowed and hold.kind == kind and borrow(other):
                units = [u for u in hold.units if u not in lent]
                if units:
                    found[other] = units
        return dict(sorted(found.items(), key=lambda item: -int(borrow(item[0]))))

    def take(
        self,
        holder: Holder,
        n: int,
        kind: str,
        label: str = "",
        *,
        queued: bool = False,
        borrow: Callable[[Holder], int] | None = None,
    ) -> tuple[str, ...] | None:
        """`n` units for `holder` if free now (the ones it holds already, if it holds some), else None.

        Units of the holders `borrow` picks come first (a call in a kept world runs on that world's GPUs), then
        free ones. A CPU call asking for more slots than exist gets every slot once all are free. With `queued`,
        the holder is in the waiting line and gets its units only when no one ahead of it could take theirs.
        """
        self.check(n, kind)
        with self._changed:
            if holder in self._held:
                return self._held[holder].units
            if not queued and self._queue:
                return None  # others wait already: first come, first served
            if queued and self._queue and self._queue[0] != holder:
                return None
            lendable = self._lendable(kind, holder, borrow)
            free = self._free(kind)
            want = min(n, self.total(kind)) if kind == CPU else n
            if len(free) + sum(map(len, lendable.values())) < want:
                return None
            loans: dict[Holder, tuple[str, ...]] = {}
            units: list[str] = []
            for lender, lent_units in lendable.items():
                part = tuple(lent_units[: want - len(units)])
                if part:
                    loans[lender] = part
                    units += part
            need = want - len(units)
            if need:
                own = free[:need]
                if self.leases is not None:
                    leased = self.leases.lease_all(kind, free, need, label or str(holder))
                    if leased is None:
                        return None  # held by another process of this user on the machine
                    self._leased[holder] = leased
                    own = [lease.unit for lease in leased]
                units += own
            if loans:
                self._borrowed[holder] = loans
            self._held[holder] = Hold(kind, tuple(units), label or str(holder))
            if holder in self._queue:
                self._queue.remove(holder)
            self._changed.notify_all()
            return self._held[holder].units

    def wait_take(
        self,
        holder: Holder,
        n: int,
        kind: str,
        label: str = "",
        cancelled: Callable[[], bool] = lambda: False,
        borrow: Callable[[Holder], int] | None = None,
        tick: Callable[[], None] | None = None,
    ) -> tuple[str, ...]:
        """Wait in line until `n` units are free and take them; JobCancelledError if `cancelled()` turns True.
        `tick()` is called between two looks (the owner asks other processes' idle hot ranks to end there)."""
        with self._changed:
            if holder not in self._queue:
                self._queue.append(holder)
        try:
            while True:
                units = self.take(holder, n, kind, label, queued=True, borrow=borrow)
                if units is not None:
                    return units
                if cancelled():
                    raise JobCancelledError(f"{label or str(holder)} was cancelled while it waited for {n} {kind}(s).")
                if tick is not None:
                    tick()
                with self._changed:
                    self._changed.wait(_WAIT_STEP)
        finally:
            with self._changed:
                if holder in self._queue:
                    self._queue.remove(holder)
                self._changed.notify_all()

    def hand_over(self, holder: Holder, to: Holder, label: str, yields: bool = False) -> bool:
        """`holder`'s own units (not those it borrowed) are `to`'s from now on, their leases relabelled, with no
        moment free between (a call's units kept by the world it leaves); False if it owns none. `yields`: `to` is
        idle hot ranks, which another process that needs the units may ask to end."""
        with self._changed:
            hold = self._held.get(holder)
            if hold is None or to in self._held:
                return False
            loans = self._borrowed.get(holder, {})
            lent = {u for units in loans.values() for u in units}
            own = tuple(u for u in hold.units if u not in lent)
            if not own:
                return False
            self._held[holder] = Hold(hold.kind, tuple(u for u in hold.units if u in lent), hold.label)
            self._held[to] = Hold(hold.kind, own, label)
            leases = self._leased.pop(holder, [])
            if leases:
                self._leased[to] = leases
                if self.leases is not None:
                    self.leases.relabel(leases, label, yields)
            self._changed.notify_all()
            return True

    def give_back(self, holder: Holder) -> None:
        """`holder`'s units are free again (nothing if it holds none); what it borrowed goes back to its lender,
        and what others borrow from it is theirs now."""
        with self._changed:
            hold = self._held.pop(holder, None)
            self._borrowed.pop(holder, None)
            leases = self._leased.pop(holder, [])
            for borrower, loans in list(self._borrowed.items()):
                units = loans.pop(holder, ())
                if not units:
                    continue
                if not loans:
                    del self._borrowed[borrower]
                moved = [lease for lease in leases if lease.unit in units]
                leases = [lease for lease in leases if lease.unit not in units]
                self._leased.setdefault(borrower, []).extend(moved)
                if moved and self.leases is not None:
                    self.leases.relabel(moved, self._held[borrower].label)
            if self.leases is not None:
                self.leases.release(leases)
            if hold is not None:
                self._changed.notify_all()

    def elsewhere(self, kind: str) -> dict[str, str]:
        """Units free in this process that another process holds: unit -> who ("call 2 (train) (cli pid 7)")."""
        if self.leases is None:
            return {}
        with self._changed:
            free = self._free(kind)
        found = {unit: self.leases.holder(kind, unit) for unit in free}
        return {unit: who for unit, who in found.items() if who is not None}

    def yielding_elsewhere(self, kind: str) -> set[int]:
        """The pids of other processes whose idle hot ranks hold units of `kind` free in this process."""
        if self.leases is None:
            return set()
        with self._changed:
            free = self._free(kind)
        found = (self.leases.holder_info(kind, unit) for unit in free)
        return {int(info["pid"]) for info in found if info and info.get("yields") and isinstance(info.get("pid"), int)}

    def why_waiting(self, n: int, kind: str) -> str:
        """'2 CPU slot(s); 0 of 2 free, held by call 1 (train)': what a call of `n` units waits for."""
        elsewhere = self.elsewhere(kind)
        with self._changed:
            free = len(self._free(kind)) - len(elsewhere)
            here = [h.label for h in self._held.values() if h.kind == kind]
        who = ", ".join(dict.fromkeys([*here, *elsewhere.values()])) or "calls ahead in line"
        unit = "GPU(s)" if kind == GPU else "CPU slot(s)"
        return f"{n} {unit}; {free} of {self.total(kind)} free, held by {who}"


def _visible_gpus() -> list[str]:
    from .. import accelerators

    count = accelerators.detect().gpu_count
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return ids[:count]
    return [str(i) for i in range(count)]


def cpu_slots() -> int:
    """CPU worker slots of this node: $AIR_MAGIC_CPU_SLOTS, else the core count."""
    text = os.environ.get(CPU_SLOTS, "").strip()
    if not text:
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(f"{CPU_SLOTS}={text!r} must be a whole number of CPU worker slots, 1 or more.")
    return value


def machine_ledger(role: Callable[[], str] = lambda: "kernel") -> Ledger:
    """A ledger of this node's GPUs and $AIR_MAGIC_CPU_SLOTS, its units leased machine-wide (the owner makes one;
    `role()`: its kind of process, as the lease files name the holder)."""
    from .leases import lease_dir

    return Ledger(_visible_gpus(), cpu_slots(), Leases(lease_dir(), role))


def kind_of(spec: JobSpec) -> str:
    return GPU if spec.uses_gpu else CPU
