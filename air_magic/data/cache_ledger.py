"""The cache directory as the ledger every process shares: its files, the lock every decision about space takes, and
what a look at it finds (complete files, live partial downloads, other processes' pins).

Layout under the cache directory (mode 0700):

    .lock                 flock'ed for every decision about space (short critical sections)
    .wanted               its mtime is renewed while a process waits for room (see "pressure")
    data/<key>            complete files; their mtime is the last use (least recently used goes first)
    part/<key>.<pid>.<size>.part   a download in progress, counted at its full size
    pins/<pid>            keys a live process still needs (prefetched, yielded and maybe unread, or
                          about to be fetched), rewritten once per batch of upcoming files

The filesystem is the only ledger, so nothing is lost or stuck when a process dies: the kernel drops a dead
process's flock, and a scan deletes the dead one's partial downloads and ignores its pins. Also the byte
arithmetic the reader's budget is checked with (`cache_need`, `human_size`). Not for deciding what to evict or
when to wait for room, nor for fetching (cache.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

_PART = re.compile(r"^(?P<key>.+)\.(?P<pid>[0-9]+)\.(?P<size>[0-9]+)\.part$")

# flock belongs to the open file description, which a forked child shares: a lock held by one thread
# while another forks (a DataLoader starting its workers) would outlive the parent's close. The child
# closes its copies; the guard keeps a fork from falling between opening a lock and recording it.
_HELD: set[int] = set()
_FORK_GUARD = threading.Lock()


def _close_held_in_child() -> None:
    global _FORK_GUARD
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()
    _FORK_GUARD = threading.Lock()


os.register_at_fork(
    before=lambda: _FORK_GUARD.acquire(),
    after_in_parent=lambda: _FORK_GUARD.release(),
    after_in_child=_close_held_in_child,
)


#: A process of this pid exists (one of another user's counts as alive).
alive = psutil.pid_exists


def cache_key(url: str, size: int, version: str) -> str:
    """A file name for one version of one remote file: a digest, then the readable base name."""
    digest = hashlib.sha256(f"{url}\0{size}\0{version}".encode()).hexdigest()[:24]
    base = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:]
    return f"{digest}-{base}"


def cache_need(sizes: list[int] | tuple[int, ...], readers: int, keep: int) -> int:
    """Bytes that `readers` processes, each keeping its last `keep` files pinned, may hold at once (worst case).

    That is the `readers * keep` largest files (every file at most once: a file twice in the cache is one file).
    """
    count = min(len(sizes), max(0, readers) * max(0, keep))
    return sum(sorted(sizes, reverse=True)[:count])


def human_size(n: int) -> str:
    """Bytes, with a binary unit when that is shorter to read: "8388608 bytes (8.0 MiB)"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n} bytes ({n / scale:.1f} {unit})"
    return f"{n} bytes"


@contextmanager
def locked(directory: str) -> Iterator[None]:
    """The cache's lock, held for one decision about space (released in a forked child, never shared with it)."""
    with _FORK_GUARD:
        fd = os.open(os.path.join(directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        _HELD.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with _FORK_GUARD:
            _HELD.discard(fd)
            os.close(fd)  # closing the descriptor drops the lock (no forked child holds a copy)


def scan(directory: str, clean: bool = True) -> tuple[dict[str, tuple[int, float]], dict[str, int], set[str]]:
    """(complete files: key -> (size, last use), live partial downloads: name -> size, keys other live processes
    pinned); `clean`: remove what dead processes left."""
    data: dict[str, tuple[int, float]] = {}
    for entry in os.scandir(os.path.join(directory, "data")):
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        data[entry.name] = (st.st_size, st.st_mtime)
    parts: dict[str, int] = {}
    for entry in os.scandir(os.path.join(directory, "part")):
        m = _PART.match(entry.name)
        if m is None or not alive(int(m["pid"])):
            if clean:
                remove(entry.path)  # left by a process that died mid-download
            continue
        parts[entry.name] = int(m["size"])
    pinned: set[str] = set()
    for entry in os.scandir(os.path.join(directory, "pins")):
        owner = entry.name.split(".", 1)[0]
        pid = int(owner) if owner.isdigit() else -1
        if pid == os.getpid():
            continue
        if pid < 0 or not alive(pid):
            if clean:
                remove(entry.path)
            continue
        if entry.name != owner:
            continue  # a pins file being rewritten: the current one is still there
        try:
            with open(entry.path) as f:
                pinned.update(line for line in f.read().split("\n") if line)
        except FileNotFoundError:
            continue
    return data, parts, pinned


def remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
