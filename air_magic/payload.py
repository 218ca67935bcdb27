"""Serialize what a call runs (function or cell, plus its arguments) for the workers.

cloudpickle pickles notebook functions and classes by value, which plain
pickle and torch.multiprocessing cannot do. Modules the notebook imported
that are not installed packages (a `helpers.py` beside the notebook, a
package folder on a `sys.path` entry outside site-packages and the standard
library) travel by value too, so a rank runs the notebook's copy even on a
node where that file is missing or older, and their code travels beside the
call so that an `import` of one on a rank finds the notebook's copy
(notebook_code.py, launch/rank/carried.py); installed packages and the standard
library are imported by name on the rank. When something does not
pickle, this module finds which argument or global is to blame and says so,
before any worker starts. It does not start processes or read results.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, ModuleType
from typing import Any

import cloudpickle

from .errors import SerializationError
from .launch.rank.carried import pack
from .notebook_code import carried_modules, notebook_modules

#: Payloads above this many bytes get a PayloadSizeWarning.
LARGE_PAYLOAD_BYTES = 256 * 1024 * 1024


class PayloadSizeWarning(UserWarning):
    """The serialized call is large; data should rather be loaded inside the function."""


def _pickles(value: Any) -> Exception | None:
    try:
        cloudpickle.dump(value, _NullWriter())
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return exc
    return None


class _NullWriter(io.RawIOBase):
    """A sink for trial pickling: counts the bytes, keeps nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.size += n
        return n


def _pickled_size(value: Any) -> int:
    sink = _NullWriter()
    try:
        cloudpickle.dump(value, sink, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - it pickled as part of the whole; alone it only needs sizing
        return 0
    return sink.size


def _largest_part(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Which argument or global makes up most of a large payload, e.g. "global 'data' (300 MiB)"."""
    parts = [(f"positional argument {i}", v) for i, v in enumerate(args)]
    parts += [(f"argument {k!r}", v) for k, v in kwargs.items()]
    names = getattr(target, "payload_globals", None)
    used = names() if callable(names) else referenced_globals(target)
    parts += [(f"global {k!r}", v) for k, v in used.items() if not inspect.ismodule(v)]
    if not parts:
        return ""
    size, name = max((_pickled_size(v), name) for name, v in parts)
    return f" ({name}: {size / 2**20:.0f} MiB)" if size else ""


def _user_stacklevel() -> int:
    """The stacklevel that points a warning raised in serialize() at the first frame outside air_magic."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame: FrameType | None = sys._getframe(1)  # level 1 is serialize() itself
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame, level = frame.f_back, level + 1
    return level


def referenced_globals(func: Callable[..., Any]) -> dict[str, Any]:
    """Globals and closure values a function uses, nested code objects included."""
    found: dict[str, Any] = {}
    func = inspect.unwrap(func)
    code = getattr(func, "__code__", None)
    glb = getattr(func, "__globals__", {})
    if code is None:
        return found
    stack = [code]
    while stack:
        c = stack.pop()
        for name in c.co_names:
            if name in glb:
                found[name] = glb[name]
        stack.extend(k for k in c.co_consts if inspect.iscode(k))
    for name, cell in zip(code.co_freevars, func.__closure__ or ()):
        try:
            found[name] = cell.cell_contents
        except ValueError:
            pass
    return found


def cell_sources(func: Any) -> dict[str, Any]:
    """Where the function's code came from, so a remote traceback can show the cell's lines.

    cloudpickle renames the file of code it pickles by value to
    '<dynamic-code>', and IPython keeps cell sources only in the kernel's
    linecache. This records each code object's file, keyed by name and first
    line, and the lines of files that exist only in linecache.
    """
    own = getattr(func, "payload_sources", None)
    if callable(own):  # a target that is not a function (a cell) says where its code came from
        return own()
    files: dict[str, list[str]] = {}
    code_files: dict[str, str] = {}
    code = getattr(inspect.unwrap(func), "__code__", None) if not inspect.iscode(func) else func
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        name = c.co_filename
        code_files[f"{c.co_name}:{c.co_firstlineno}"] = name
        if name not in files and not os.path.exists(name):
            lines = linecache.getlines(name)
            if lines:
                files[name] = lines
        stack.extend(k for k in c.co_consts if inspect.iscode(k))
    return {"files": files, "code": code_files}


def _culprits(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterable[str]:
    for i, value in enumerate(args):
        if (exc := _pickles(value)) is not None:
            yield f"positional argument {i} ({type(value).__name__}): {exc}"
    for key, value in kwargs.items():
        if (exc := _pickles(value)) is not None:
            yield f"argument {key!r} ({type(value).__name__}): {exc}"
    names = getattr(target, "payload_globals", None)
    used = names() if callable(names) else referenced_globals(target)
    for name, value in used.items():
        if (exc := _pickles(value)) is not None:
            yield f"global {name!r} ({type(value).__name__}): {exc}"


@contextlib.contextmanager
def _by_value(modules: list[ModuleType]) -> Iterator[None]:
    """While pickling: `modules` (and their submodules) by value; registrations made here are undone after."""
    registered = set(cloudpickle.list_registry_pickle_by_value())
    added = [m for m in modules if m.__name__ not in registered]
    for module in added:
        cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        for module in added:
            with contextlib.suppress(ValueError):
                cloudpickle.unregister_pickle_by_value(module)


def serialize(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """cloudpickle `(target, args, kwargs, cell sources)`, naming the culprit if it cannot be done.

    Notebook modules (see `notebook_modules`) go by value; if one of them holds something that cannot
    be pickled, the call falls back to importing them by name on the ranks. Either way their code travels
    too (`carried_modules`, launch/rank/carried.py), so an `import` of one of them on a rank finds the notebook's copy.
    """
    call = (target, args, kwargs, cell_sources(target))
    try:
        with _by_value(notebook_modules()):
            blob = cloudpickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - judged again below, with the modules by name
        blob = b""
    try:
        blob = blob or cloudpickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        found = list(_culprits(target, args, kwargs))
        what = "; ".join(found) if found else f"the function itself: {exc}"
        raise SerializationError(
            f"cannot send this call to the workers: {what}. Create such objects inside the "
            "function (locks, sockets, open files, database connections cannot cross processes) "
            "or pass something that can be pickled."
        ) from exc
    blob = pack(carried_modules(), blob)
    if len(blob) > LARGE_PAYLOAD_BYTES:
        # Pointed at the user's cell, so each cell that sends too much data warns, not only the first.
        warnings.warn(
            f"the serialized call is {len(blob) / 2**20:.0f} MiB{_largest_part(target, args, kwargs)} "
            "and is written to disk and read by every rank; load large data inside the function "
            "(from files or a dataset) instead of passing it or capturing it from the notebook.",
            PayloadSizeWarning,
            stacklevel=_user_stacklevel(),
        )
    return blob
