"""The exception tree users see, and the small helpers that word failures.

How an exception crosses from a rank to the notebook is launch/files/errorfile.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any


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


class RankHungError(AirMagicError):
    """A rank made no progress while others waited for it in a collective, and the call's `on_hang` stopped it."""


class RunDirectoryFullError(AirMagicError, OSError):
    """The disk holding the run directory filled up; the ranks could not write their logs or results."""


class JobCancelledError(AirMagicError):
    """The call was cancelled from the panel; every worker was stopped."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback: a cancel is a request, not a bug.
        return [f"{type(self).__name__}: {self}"]


class DebuggerQuit(AirMagicError):
    """`q` at a rank's debugger prompt (`breakpoint()`) ended the call; every rank was stopped."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback: quitting the debugger is a request, not a bug.
        return [f"{type(self).__name__}: {self}", *getattr(self, "__notes__", [])]


class ResultSizeWarning(UserWarning):
    """A rank returned a large value; every byte of it is copied into the notebook's memory."""


class ListenerWarning(RuntimeWarning):
    """A display or tracking listener failed; the call itself went on unchanged."""


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the `__cause__` of the error raised here."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text


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
