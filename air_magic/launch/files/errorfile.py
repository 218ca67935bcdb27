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

from ... import portable
from ...errors import RankFailedError, RemoteTraceback
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


def _fit(record: dict, limit: int) -> bytes:
    """The record as JSON of at most `limit` bytes: a traceback too long keeps its start and, mostly, its end."""
    data = json.dumps(record).encode()
    if len(data) <= limit:
        return data
    record = {**record, "message": record["message"][:4096]}
    text = record["traceback"]
    room = max(0, limit - len(json.dumps({**record, "traceback": ""}).encode()) - 256)
    keep = room // 12  # json may escape one character into up to 12 bytes; halve until it fits
    while True:
        head, tail = keep // 4, keep - keep // 4
        cut = f"{text[:head]}\n[... {len(text) - keep:,} characters cut to fit the error record ...]\n"
        cut += text[len(text) - tail :] if tail else ""
        data = json.dumps({**record, "traceback": cut}).encode()
        if len(data) <= limit or keep == 0:
            return data
        keep //= 2


def _write_into_reserve(reserve: Path, path: Path, data: bytes) -> None:
    """Write `data` over the space set aside at `reserve` (no new blocks needed), then name it `path`."""
    with open(reserve, "r+b") as f:
        f.write(data)
        f.truncate()
    os.replace(reserve, path)


def write_error_file(
    path: Path,
    pickle_path: Path,
    exc: BaseException,
    code_files: dict[str, str] | None = None,
    reserve: Path | None = None,
) -> None:
    """Record `exc` for the caller: a JSON summary at `path`, and the exception at `pickle_path` if it pickles.

    With `reserve` (the space RunDir set aside for this record), the summary is
    written into it, so it lands even when the disk is full.
    """
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
    if reserve is not None and reserve.exists():
        _write_into_reserve(reserve, path, _fit(record, reserve.stat().st_size))
    else:
        _write_or_remove(path, json.dumps(record).encode())
    # an exception that pickles but cannot be rebuilt is useless, hence the round trip
    try:
        blob = portable.dumps(exc)
        cloudpickle.loads(blob)
    except Exception:  # noqa: BLE001 - any failure means: send the summary only
        return
    try:
        _write_or_remove(pickle_path, blob)
    except OSError:
        pass  # the summary is written; the caller shows the exception by name


def _write_or_remove(path: Path, data: bytes) -> None:
    """Write `data` to `path`; if that fails, leave no half-written file behind."""
    try:
        write_private(path, data, exclusive=False)
    except OSError:
        path.unlink(missing_ok=True)
        raise


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
