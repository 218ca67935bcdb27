"""A session on a rank: the namespace that session cells and functions share, and what a call leaves there.

A session's ranks are hot ranks (local/pool.py on one node) that also keep what
the user's code built. Each rank process holds one `Namespace`: a cell runs in
it (the notebook globals it reads travel each time, except the names the
session assigned itself, which win), a function's free globals resolve in it
first, and a `Ref("name")` argument is replaced by the rank's own object.

This module also says, after a call, whether the rank may be kept: an
exception raised by user code keeps it; one from inside `torch.distributed`
or a sticky CUDA error does not (`ends_session`). And it turns the last value
into what travels back: the value itself, or a `Placeholder` when it cannot be
pickled or is over `RESULT_LIMIT` (the object stays on the rank as `_`).

How a session call takes Ctrl-C on a rank is interrupts.py's.

Runs in the worker (both launchers' ranks) and is imported by the notebook for
`Ref` and `Placeholder`; it imports no IPython and no torch.

Over 300 lines because a session's rules on the rank (what a cell may read, what wins, what ends it, what a call
leaves) are one concern and read best together.
"""

from __future__ import annotations

import builtins
import gc
import inspect
import os
import reprlib
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from ... import portable

#: A session cell's last value pickled above this many bytes stays on the rank (as `_`) and a placeholder comes back.
RESULT_LIMIT = 64 * 2**20
#: Characters of a kept object's repr shown in its placeholder.
REPR_CHARS = 200


@dataclass(frozen=True)
class Ref:
    """An argument that names an object on the ranks: each rank gets its own `name` from its session namespace.

    `train.distributed(Ref("model"), lr=0.1)` passes every rank its own `model`.
    """

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"Ref needs the name of a variable on the ranks, such as Ref('model'), got {self.name!r}")

    def __repr__(self) -> str:
        return f"Ref({self.name!r})"


@dataclass(frozen=True)
class Placeholder:
    """What the notebook gets for a last value that stayed on its rank (unpicklable, or too large to bring back)."""

    rank: int
    type_name: str
    text: str
    why: str

    def __repr__(self) -> str:
        return f"<kept on rank {self.rank} as _: {self.type_name} {self.text} ({self.why})>"


@dataclass
class Reply:
    """What a session rank sends back for one call: its value (or a Placeholder) and the names it holds."""

    value: Any
    #: name -> "type, size" of every name the session assigned, for %distributed_session.
    names: dict[str, str] = field(default_factory=dict)


class Namespace:
    """One rank's session state: the globals session cells run in, and which of them the session assigned."""

    def __init__(self) -> None:
        self.globals: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        #: Names the session's own code (or a push) assigned: they win over notebook globals of the same name.
        self.owned: set[str] = set()

    def lookup(self, name: str, rank: int) -> Any:
        if name not in self.globals:
            raise NameError(f"name {name!r} is not defined in the session on rank {rank}", name=name)
        return self.globals[name]

    def assign(self, values: dict[str, Any]) -> None:
        self.globals.update(values)
        self.owned.update(values)

    def reset(self) -> None:
        """Forget every name (the processes, their process group and imports stay)."""
        self.globals.clear()
        self.globals.update({"__name__": "__main__", "__builtins__": builtins})
        self.owned.clear()
        gc.collect()

    def summary(self) -> dict[str, str]:
        """name -> "type, size" of what the session assigned, for listing without touching the objects' data."""
        return {name: describe(self.globals[name]) for name in sorted(self.owned) if name in self.globals}


#: This process's session namespace (a rank belongs to one session).
namespace = Namespace()
_UNBOUND = object()


def describe(value: Any) -> str:
    """`Tensor[4, 3] float32, 48 B` / `Linear, 1.2 MiB` / `int`: a name's type and, where cheap to know, its size."""
    kind = type(value).__name__
    torch = sys.modules.get("torch")
    size: int | None = None
    if torch is not None and isinstance(value, torch.Tensor):
        kind = f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')} on {value.device}"
        size = value.element_size() * value.nelement()
    elif torch is not None and isinstance(value, torch.nn.Module):
        size = sum(t.element_size() * t.nelement() for t in (*value.parameters(), *value.buffers()))
    elif isinstance(value, (bytes, bytearray, str, list, dict, tuple, set)):
        size = sys.getsizeof(value)
    return kind if size is None else f"{kind}, {human_bytes(size)}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


class SessionOp:
    """An operation on the namespace itself (push, pull, reset), sent as a call's target."""

    def apply(self, ns: Namespace, rank: int) -> Any:
        raise NotImplementedError

    def __call__(self) -> Any:
        raise TypeError(f"{type(self).__name__} acts on a session's namespace and runs only as a session's call")


@dataclass
class Push(SessionOp):
    """Assign notebook values on the rank; they belong to the session from then on."""

    values: dict[str, Any]

    def apply(self, ns: Namespace, rank: int) -> Any:
        ns.assign(self.values)
        return sorted(self.values)


@dataclass
class Pull(SessionOp):
    """Send back the value of one name on the rank."""

    name: str

    def apply(self, ns: Namespace, rank: int) -> Any:
        return ns.lookup(self.name, rank)


@dataclass
class Reset(SessionOp):
    """Empty the namespace; the processes stay."""

    def apply(self, ns: Namespace, rank: int) -> Any:
        ns.reset()
        return None


def resolve_refs(value: Any, ns: Namespace, rank: int) -> Any:
    """`value` with every `Ref` (also inside lists, tuples and dicts) replaced by the rank's object of that name."""
    if isinstance(value, Ref):
        return ns.lookup(value.name, rank)
    if isinstance(value, list):
        return [resolve_refs(v, ns, rank) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(resolve_refs(v, ns, rank) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: resolve_refs(v, ns, rank) for k, v in value.items()}
    return value


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def in_session(func: Any, ns: Namespace) -> Any:
    """A notebook function whose free globals resolve in the session namespace first (ipyparallel's rule).

    A function defined in an importable module keeps its module's globals.
    """
    if not inspect.isfunction(func) or func.__module__ != "__main__":
        return func
    wanted = {name for name in _global_names(func.__code__) if name in ns.globals and not name.startswith("__")}
    func.__globals__.update({name: ns.globals[name] for name in wanted})
    return func


def run(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rank: int) -> Any:
    """Run one call's target in this rank's session; the value it returns (a cell's last expression)."""
    ns = namespace
    if isinstance(target, SessionOp):
        return target.apply(ns, rank)
    args = resolve_refs(args, ns, rank)
    kwargs = resolve_refs(kwargs, ns, rank)
    run_in = getattr(target, "run_in", None)  # a %%distributed cell (cell.CellProgram)
    if run_in is not None:
        return run_in(ns.globals, ns.owned)
    func = in_session(target, ns)
    if func is target and not inspect.isfunction(func):
        return func(*args, **kwargs)
    before = dict(func.__globals__)
    try:
        return func(*args, **kwargs)
    finally:  # what the function bound with `global name` belongs to the session, as a cell's names do
        if func.__module__ == "__main__":
            ns.assign(
                {
                    name: value
                    for name, value in func.__globals__.items()
                    if not name.startswith("__") and before.get(name, _UNBOUND) is not value
                }
            )


def reply(value: Any, rank: int) -> bytes:
    """The pickled `Reply` of a call: the value, or a placeholder if it cannot travel (the object then stays as `_`)."""
    names = namespace.summary()
    try:
        data = portable.dumps(Reply(value, names))
    except Exception as exc:  # noqa: BLE001 - whatever pickling raised, the cell itself succeeded
        why = f"it cannot be pickled: {type(exc).__name__}: {exc}"
    else:
        if len(data) <= RESULT_LIMIT:
            return data
        why = f"{human_bytes(len(data))} pickled, over the {human_bytes(RESULT_LIMIT)} a session cell brings back"
    namespace.globals["_"] = value
    namespace.owned.add("_")
    shorten = reprlib.Repr()
    shorten.maxstring = shorten.maxother = REPR_CHARS
    text = shorten.repr(value)
    return portable.dumps(Reply(Placeholder(rank, type(value).__name__, text, why), namespace.summary()))


def ends_session(exc: BaseException) -> str | None:
    """Why an exception from a session call leaves the rank unusable, or None if the session may be kept.

    An error from inside torch.distributed leaves the process group in an unknown state (a peer may be
    waiting in a collective); a CUDA error is sticky: every later CUDA call in the process fails too.
    """
    kind = type(exc)
    if kind.__module__.startswith("torch") and kind.__name__.startswith("Dist"):
        return f"{kind.__name__} from torch.distributed leaves the process group unusable"
    if kind.__name__ == "AcceleratorError" or "CUDA error" in str(exc):
        return "a CUDA error is sticky: every later CUDA call in that process fails too"
    marker = f"{os.sep}torch{os.sep}distributed{os.sep}"
    tb = exc.__traceback__
    while tb is not None:
        if marker in tb.tb_frame.f_code.co_filename:
            return f"{kind.__name__} raised inside torch.distributed leaves the process group unusable"
        tb = tb.tb_next
    return None


def drop_traceback(exc: BaseException) -> None:
    """After a failed call: let go of the frames (and the locals they hold) of the exception's traceback."""
    import traceback

    if exc.__traceback__ is not None:
        traceback.clear_frames(exc.__traceback__)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
