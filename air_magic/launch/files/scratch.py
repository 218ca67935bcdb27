"""A Ray rank's scratch directories on its node: made held by their process, and removed when it is gone.

A rank placed by another machine's launcher (launch/ray/rank.py) works in a private directory of this machine's
temporary directory (RunDir.scratch). Its process removes it when the call is over; a process killed with its node
cannot. So each one holds a lock on its directory's `.held` file while it lives (the kernel lets go of it when the
process ends, however it ends), and `sweep`, which each rank actor runs at its first call, removes the directories
no process holds. Nothing here starts a process.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

#: How a scratch directory's name starts, in the machine's temporary directory.
PREFIX = "air_magic-"
#: The file of a scratch directory that its process holds locked while it uses the directory.
HELD = ".held"
_held: dict[Path, int] = {}  # scratch directory -> the descriptor of its locked `.held`


def make(name: str) -> Path:
    """A new private directory named after `name`, held by this process until `release` or its end."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40]
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{safe}-"))
    fd = os.open(path / (HELD + ".new"), os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(path / (HELD + ".new"), path / HELD)  # `.held` is never seen unlocked while its process lives
    _held[path] = fd
    return path


def release(path: Path) -> None:
    """This process no longer holds `path` (removed, or to be swept)."""
    fd = _held.pop(Path(path), None)
    if fd is not None:
        os.close(fd)


def sweep() -> list[Path]:
    """Remove the scratch directories of this machine that no process holds (their process ended without removing
    them, as a Ray node killed with its ranks does); the ones removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            fd = os.open(path / HELD, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # not a scratch directory of this kind (or not ours)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: in use
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
