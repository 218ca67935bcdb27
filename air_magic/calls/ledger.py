"""The ledger of this node's GPUs and CPU worker slots: which call (or session) holds which, and who waits.

Calls that run at once never share a GPU. Every call of the kernel on this node, foreground or background,
takes its units here before its ranks start and gives them back when it ends; a session keeps its GPUs
from its first call until it ends (`keep`). A call whose units are not free waits, first come first
served, and can say what it waits for (`why_waiting`). The same rule holds for CPU worker slots: there are
`$AIR_MAGIC_CPU_SLOTS` of them (default: the machine's core count); a CPU call asking for more slots than
exist runs once every slot is free, as an oversubscribed call always has.

The ledger of `node()` is machine-wide: each unit it hands out is also leased (leases.py) by a lock the OS
frees when this process ends, so kernels, command-line runs and detached calls of this user on the machine
never share a unit, and a call waiting for one held elsewhere names that holder (kernel, cli or detached, and
its call). The line of waiting calls is this process's; between processes, the first to find units free
takes them.

`Ledger` is a plain object (tests/unit/test_ledger.py): `take(holder, n, kind)` / `give_back(holder)`,
`holders()`. `node()` is the one ledger of this process. `Claim` is how a call uses it: take now or wait,
then hand the call's spec its GPUs (`CUDA_VISIBLE_DEVICES`). Not for: starting or stopping processes.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
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


@dataclass(frozen=True)
class Kept:
    """The holder of the GPUs a session keeps from its first call until it ends (`release_session`)."""

    session: str


#: Who holds units: a call (its key, such as "call 3"), or a session keeping them between its calls (`Kept`).
Holder = Hashable


class Ledger:
    """GPUs and CPU slots of one node, and who holds them; thread-safe."""

    def __init__(self, gpus: list[str], cpu_slots: int, leases: Leases | None = None) -> None:
        self.units = {GPU: list(gpus), CPU: [str(i) for i in range(max(1, cpu_slots))]}
        self._held: dict[Holder, Hold] = {}
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

    def take(
        self, holder: Holder, n: int, kind: str, label: str = "", *, queued: bool = False
    ) -> tuple[str, ...] | None:
        """`n` units for `holder` if free now (the ones it holds already, if it holds some), else None.

        A CPU call asking for more slots than exist gets every slot once all are free. With `queued`, the holder
        is in the waiting line and gets its units only when no one ahead of it could take theirs.
        """
        self.check(n, kind)
        with self._changed:
            if holder in self._held:
                return self._held[holder].units
            if not queued and self._queue:
                return None  # others wait already: first come, first served
            if queued and self._queue and self._queue[0] != holder:
                return None
            free = self._free(kind)
            want = min(n, self.total(kind)) if kind == CPU else n
            if len(free) < want:
                return None
            units = tuple(free[:want])
            if self.leases is not None:
                leased = self.leases.lease_all(kind, free, want, label or str(holder))
                if leased is None:
                    return None  # held by another process of this user on the machine
                self._leased[holder] = leased
                units = tuple(lease.unit for lease in leased)
            self._held[holder] = Hold(kind, units, label or str(holder))
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
    ) -> tuple[str, ...]:
        """Wait in line until `n` units are free and take them; JobCancelledError if `cancelled()` turns True."""
        with self._changed:
            if holder not in self._queue:
                self._queue.append(holder)
        try:
            while True:
                units = self.take(holder, n, kind, label, queued=True)
                if units is not None:
                    return units
                if cancelled():
                    raise JobCancelledError(f"{label or str(holder)} was cancelled while it waited for {n} {kind}(s).")
                with self._changed:
                    self._changed.wait(_WAIT_STEP)
        finally:
            with self._changed:
                if holder in self._queue:
                    self._queue.remove(holder)
                self._changed.notify_all()

    def give_back(self, holder: Holder) -> None:
        """`holder`'s units are free again (nothing if it holds none)."""
        with self._changed:
            self._held.pop(holder, None)
            if self.leases is not None:
                self.leases.release(self._leased.pop(holder, []))
            self._changed.notify_all()

    def elsewhere(self, kind: str) -> dict[str, str]:
        """Units free in this process that another process holds: unit -> who ("call 2 (train) (cli pid 7)")."""
        if self.leases is None:
            return {}
        with self._changed:
            free = self._free(kind)
        found = {unit: self.leases.holder(kind, unit) for unit in free}
        return {unit: who for unit, who in found.items() if who is not None}

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


_node: Ledger | None = None
_node_lock = threading.Lock()


def node() -> Ledger:
    """The one ledger of this process (made at first use from the node's GPUs and $AIR_MAGIC_CPU_SLOTS), its units
    leased machine-wide."""
    global _node
    with _node_lock:
        if _node is None:
            from .leases import lease_dir

            _node = Ledger(_visible_gpus(), cpu_slots(), Leases(lease_dir()))
        return _node


def kind_of(spec: JobSpec) -> str:
    return GPU if spec.uses_gpu else CPU


class Claim:
    """One call's use of the ledger: try now, or wait in line; then run with its units; then give them back.

    A call on several nodes (Ray) places its ranks there, not here: it claims nothing.
    """

    def __init__(self, spec: JobSpec, holder: str, label: str) -> None:
        self.spec = spec
        self.holder: Holder = Kept(spec.session) if spec.session is not None and spec.uses_gpu else holder
        self.label = label if spec.session is None else f"session {spec.session!r} ({label})"
        self.applies = spec.num_nodes == 1
        self.units: tuple[str, ...] | None = None
        self.kept = False
        if self.applies:
            node().check(spec.world_size, kind_of(spec))

    def try_now(self) -> bool:
        if not self.applies:
            return True
        self.units = node().take(self.holder, self.spec.world_size, kind_of(self.spec), self.label)
        return self.units is not None

    def why_waiting(self) -> str:
        return node().why_waiting(self.spec.world_size, kind_of(self.spec))

    def wait(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        if self.applies and self.units is None:
            self.units = node().wait_take(self.holder, self.spec.world_size, kind_of(self.spec), self.label, cancelled)

    def keep(self) -> None:
        """A session's GPUs stay held after the call, until the session ends (`release_session`)."""
        self.kept = isinstance(self.holder, Kept)

    def release(self) -> None:
        if self.applies and not self.kept:
            node().give_back(self.holder)

    def apply(self, spec: JobSpec) -> JobSpec:
        """`spec` with its GPUs as CUDA_VISIBLE_DEVICES (a CPU call is unchanged)."""
        if not self.applies or not spec.uses_gpu or not self.units or "CUDA_VISIBLE_DEVICES" in spec.extra_env:
            return spec
        return dataclasses.replace(spec, extra_env={**spec.extra_env, "CUDA_VISIBLE_DEVICES": ",".join(self.units)})

    @contextmanager
    def held(self, spec: JobSpec, on_wait: Callable[[str], None] | None = None) -> Iterator[JobSpec]:
        """Hold the call's units while the block runs (waiting for them first, if need be), giving them back after."""
        if self.units is None and not self.try_now():
            if on_wait is not None:
                on_wait(self.why_waiting())
            self.wait()
        try:
            yield self.apply(spec)
        finally:
            self.release()


def release_session(name: str) -> None:
    """Session `name` ended: the GPUs it kept are free again."""
    if _node is not None:
        _node.give_back(Kept(name))
