"""The exception tree users see, and the error file a worker leaves behind.

Errors cross the process boundary as files (like torch elastic's error
files): the worker pickles its exception next to a JSON record with the type
name, message and formatted traceback, so the caller can rebuild the original
exception, or explain the failure even when the exception cannot be unpickled.
"""

from __future__ import annotations

import json
import os
import signal
import traceback
from pathlib import Path
from typing import Any

import cloudpickle


class AirMagicError(Exception):
    """Base class for errors raised by air_magic itself."""


class ConfigurationError(AirMagicError, ValueError):
    """A setting given to `distributed` or `%%distributed` cannot be used."""


class SerializationError(AirMagicError, TypeError):
    """The function, an argument or a global could not be serialized."""


class RankFailedError(AirMagicError):
    """A rank failed and its own exception could not be rebuilt here."""


class WorkerDiedError(AirMagicError, ChildProcessError):
    """A rank's process ended without a Python exception (signal, os._exit, crash)."""


class DistributedTimeoutError(AirMagicError, TimeoutError):
    """The call ran longer than its `timeout`; every worker was stopped."""


class RunDirectoryFullError(AirMagicError, OSError):
    """The disk holding the run directory filled up; the ranks could not write their logs or results."""


class JobCancelledError(AirMagicError):
    """The call was cancelled from the panel; every worker was stopped."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback: a cancel is a request, not a bug.
        return [f"{type(self).__name__}: {self}"]


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the `__cause__` of the error raised here."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


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


def write_error_file(path: Path, exc: BaseException, code_files: dict[str, str] | None = None) -> None:
    """Record `exc` for the caller: a JSON summary, and the pickled exception if it pickles."""
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
    _write_private(path, json.dumps(record).encode())
    # an exception that pickles but cannot be rebuilt is useless, hence the round trip
    try:
        blob = cloudpickle.dumps(exc)
        cloudpickle.loads(blob)
    except Exception:  # noqa: BLE001 - any failure means: send the summary only
        return
    _write_private(path.with_suffix(".pkl"), blob)


def read_error_file(path: Path, rank: int) -> BaseException | None:
    """Rebuild the exception a rank recorded at `path`, or None if it left no record."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as why:  # a half-written record (the disk filled up, the rank was killed)
        return RankFailedError(
            f"rank {rank} failed, but its error record {path} could not be read ({why}); see its log."
        )
    exc: BaseException | None = None
    blob = path.with_suffix(".pkl")
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


def describe_returncode(code: int) -> str:
    """`-9` -> 'was killed by signal 9 (SIGKILL)'; `3` -> 'exited with code 3'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def tail_text(path: Path, lines: int = 20, max_bytes: int = 64 * 1024) -> str:
    """The last `lines` lines of a log file, decoded leniently."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace").replace("\r", "\n")
    return "\n".join(text.splitlines()[-lines:])


def annotate(exc: BaseException, note: str) -> Any:
    """Attach a note shown under the traceback (PEP 678)."""
    exc.add_note(note)
    return exc
