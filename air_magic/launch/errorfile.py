"""A rank's exception, carried to the notebook as files (like torch elastic's error files).

The worker writes a JSON record (type name, message, formatted traceback) and,
when it pickles and unpickles, the exception itself; the notebook rebuilds the
original exception from them, or explains the failure by name when it cannot.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import cloudpickle

from .. import portable
from ..errors import RankFailedError, RemoteTraceback
from .rundir import write_private


def format_remote(exc: BaseException, code_files: dict[str, str] | None = None) -> str:
    """Format a traceback, putting back the real file of frames cloudpickle renamed '<dynamic-code>'."""
    te = traceback.TracebackException.from_exception(exc)
    current: traceback.TracebackException | None = te
    error: BaseException | None = exc
    while current is not None and error is not None:
        for (frame, _), summary in zip(traceback.walk_tb(error.__traceback__), current.stack):
            code = frame.f_code
            real = (code_files or {}).get(f"{code.co_name}:{code.co_firstlineno}")
            if summary.filename == "<dynamic-code>" and real:
                summary.filename = real
                summary._line = None  # type: ignore[attr-defined]  # private line cache: re-read under the real name
        current, error = current.__cause__ or current.__context__, error.__cause__ or error.__context__
    return "".join(te.format())


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as inner:  # noqa: BLE001 - a broken __str__ must not hide the failure
        return f"<str() of the exception failed: {inner!r}>"


def write_error_file(
    path: Path, pickle_path: Path, exc: BaseException, code_files: dict[str, str] | None = None
) -> None:
    """Record `exc` for the caller: a JSON summary at `path`, and the exception at `pickle_path` if it pickles."""
    try:
        text = format_remote(exc, code_files)
    except Exception:  # noqa: BLE001 - fall back to the plain formatter
        text = "".join(traceback.format_exception(exc))
    record = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": _safe_str(exc),
        "traceback": text,
        "pid": os.getpid(),
    }
    write_private(path, json.dumps(record).encode(), exclusive=False)
    # an exception that pickles but cannot be rebuilt is useless, hence the round trip
    try:
        blob = portable.dumps(exc)
        cloudpickle.loads(blob)
    except Exception:  # noqa: BLE001 - any failure means: send the summary only
        return
    write_private(pickle_path, blob, exclusive=False)


def read_error_file(path: Path, pickle_path: Path, rank: int) -> BaseException | None:
    """Rebuild the exception a rank recorded at `path` (and `pickle_path`), or None if it left no record."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as why:  # a half-written record (the disk filled up, the rank was killed)
        return RankFailedError(
            f"rank {rank} failed, but its error record {path} could not be read ({why}); see its log."
        )
    exc: BaseException | None = None
    blob = pickle_path
    if blob.exists():
        try:
            exc = cloudpickle.loads(blob.read_bytes())
        except Exception:  # noqa: BLE001 - rebuilt or not, the summary still tells
            exc = None
    if exc is None:
        exc = RankFailedError(
            f"rank {rank} raised {record['type']}: {record['message']} "
            "(the exception could not be rebuilt here, so it is shown by name)"
        )
    exc.__cause__ = RemoteTraceback(record["traceback"])
    return exc


