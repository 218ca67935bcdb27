"""Locks of torch extension builds that a killed build left behind, found before a rank's code runs.

A torch extension (a DeepSpeed op such as its CPU communication op, anything
built by `torch.utils.cpp_extension.load`) is built under a `lock` file in its
build directory; a process that finds the file waits until it is gone, with no
limit. A build killed midway (Ctrl-C, a stopped call, the OOM killer) leaves
the file, and every later build of that extension, in any call, waits forever.
The builder holds the file open while it builds, so a lock that no process
holds open is stale: `clear_stale` removes it and says so in the rank's log
(or, where holders cannot be seen, says which file to remove). It imports
nothing of torch: a rank that builds nothing pays for one directory listing.
Run as a module (`python -m air_magic.launch.rank.extension_locks`) it does
the same for an install step that builds an op.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Torch's variable for the directory extensions are built under (each extension in a directory of its own).
EXTENSIONS_DIR = "TORCH_EXTENSIONS_DIR"
#: A lock with no holder is looked at again after this many seconds before it is removed: a builder that has just
#: finished closes the file a moment before it removes it.
RECHECK = 0.2


def build_directories() -> list[Path]:
    """The directories torch builds extensions in: $TORCH_EXTENSIONS_DIR/<name>, else
    <user cache>/torch_extensions/<python and accelerator>/<name>, as torch.utils.cpp_extension names them."""
    root = os.environ.get(EXTENSIONS_DIR)
    if root:
        return [p for p in Path(root).glob("*") if p.is_dir()]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return [p for p in cache.glob("*/*") if p.is_dir()]


def holders(path: Path) -> set[int] | None:
    """The processes of this user that hold `path` open (/proc); None where that cannot be seen (no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(path)
    found: set[int] = set()
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    found.add(int(pid_dir.name))
                    break
            except OSError:
                continue
    return found


def _unheld(lock: Path) -> bool:
    """Nobody holds `lock` open, and it is still there (the same file) a moment later."""
    try:
        before = lock.stat().st_ino
    except OSError:
        return False
    if holders(lock):
        return False
    time.sleep(RECHECK)
    try:
        return lock.stat().st_ino == before and not holders(lock)
    except OSError:
        return False  # its builder removed it: it was finishing


def clear_stale(directories: list[Path] | None = None) -> list[str]:
    """Remove each build lock no process holds (a build killed midway left it); one sentence per lock found stale,
    or left because its holders cannot be seen."""
    said: list[str] = []
    for directory in build_directories() if directories is None else directories:
        lock = directory / "lock"
        if not lock.exists():
            continue
        mine = lock.stat().st_uid == os.getuid() if hasattr(os, "getuid") else True
        if holders(lock) is None or not mine:
            said.append(
                f"air_magic: {lock} exists; a build of the torch extension {directory.name!r} waits until it is "
                "gone. If no build of it is running (one killed midway leaves this file), remove it."
            )
        elif _unheld(lock):
            lock.unlink(missing_ok=True)
            said.append(
                f"air_magic: removed {lock}, left by a build of the torch extension {directory.name!r} that was "
                "killed midway (no process holds it); a build of it would have waited for it forever."
            )
    return said


def report_stale() -> None:
    """`clear_stale`, said on this process's output (a rank's: its log)."""
    try:
        said = clear_stale()
    except OSError:
        return  # an unreadable cache directory: nothing is built there either
    for line in said:
        print(line, flush=True)


if __name__ == "__main__":
    report_stale()
