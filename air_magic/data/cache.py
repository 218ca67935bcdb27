"""A private, byte-capped local cache of remote files, shared safely by processes.

The cache directory's files, its lock and what a look at them finds are cache_ledger.py; this module decides
with them: what to evict, when a download may start or must wait for room, which pins to publish, and the fetch.

A reading process announces the next files it will read (one pins-file write
per 64 files); nobody else evicts those, so it finds them cached without the
lock. Files are
published with an atomic rename, so two runs sharing a directory never see a
half-written file. A floor of free disk space is kept.

The cap: bytes on disk (complete + partial) stay within `limit`, except that the
file a process needs next may go over it by itself when nothing else is over:
that keeps a small cap from deadlocking and bounds the peak at `limit` plus one
file. The rest of the time a download waits for room. Announcements and lazily
published unpins would let files nobody is using fill the cap, so a process that
waits for room renews `.wanted`; while it is fresh, every process (a watcher
thread each, also in idle DataLoader workers) withdraws its announcements and
publishes exactly its live pins. What live pins may hold is the reader's budget
(`cache_need`): the caller checks it fits the cap before reading.

Not for local sources: those are read in place and never enter the cache.

Over 300 lines because a byte cap shared safely by several processes needs its pins, eviction and waiting for room
decided together.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from .cache_ledger import cache_key, cache_need, human_size, locked, remove, scan

__all__ = ["CacheFullError", "FetchCancelled", "FileCache", "cache_key", "cache_need", "human_size"]

WANTED_FRESH = 1.0  # seconds a wait for room is taken as still going on without being renewed


class FetchCancelled(Exception):
    """A prefetch given up because its iteration ended."""


class CacheFullError(OSError):
    """The free-disk floor cannot be kept even after evicting everything that may go."""


class FileCache:
    """The cache in `directory`; one instance per process (it keeps that process's pins)."""

    def __init__(
        self,
        directory: str,
        limit: int | None,
        min_free: int,
        retries: int = 5,
        backoff: float = 0.5,
        poll: float = 0.02,
        stall_report: float = 60.0,
    ) -> None:
        self.directory = os.path.abspath(directory)
        self.limit = limit
        self.min_free = min_free
        self.retries = retries
        self.backoff = backoff
        self.poll = poll
        self.stall_report = stall_report  # seconds a needed file waits for room before this says so on stderr
        self._pins: Counter[str] = Counter()
        self._announced: set[str] = set()
        self._published: set[str] = set()
        self._active = 0
        self._state = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._wanted = os.path.join(self.directory, ".wanted")
        for sub in ("", "data", "part", "pins"):
            path = os.path.join(self.directory, sub)
            os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)

    def path(self, key: str) -> str:
        """Where a complete file lives."""
        return os.path.join(self.directory, "data", key)

    def _locked(self) -> AbstractContextManager[None]:
        return locked(self.directory)

    def _scan(self, clean: bool = True) -> tuple[dict[str, tuple[int, float]], dict[str, int], set[str]]:
        """(complete files: key -> (size, last use), live partial downloads: name -> size, pinned keys)."""
        data, parts, pinned = scan(self.directory, clean)
        with self._state:
            pinned.update(k for k, n in self._pins.items() if n > 0)
            pinned.update(self._announced)  # needed soon by this process too
        return data, parts, pinned

    def usage(self) -> int:
        """Bytes the cache holds now: complete files plus downloads in progress at their full size."""
        data, parts, _ = self._scan(clean=False)
        return sum(size for size, _ in data.values()) + sum(parts.values())

    def _publish(self) -> None:
        """Write this process's pins file: its live pins plus the keys it announced it will need next.

        Called with the lock held (a reader never sees it half-written).
        """
        path = os.path.join(self.directory, "pins", str(os.getpid()))
        keys = {k for k, n in self._pins.items() if n > 0} | self._announced
        self._published = keys
        if not keys:
            remove(path)
            return
        with open(path, "w") as f:  # in place: every reader holds the lock, as every writer does
            f.write("\n".join(sorted(keys)) + "\n")
        if self._watcher is None:  # under self._state, as the watcher's decision to stop
            self._watcher = threading.Thread(target=self._watch, name="air-magic-cache-watch", daemon=True)
            self._watcher.start()

    def pressure(self) -> bool:
        """Whether some process is waiting for room now (it renewed `.wanted` within WANTED_FRESH seconds)."""
        try:
            return time.time() - os.stat(self._wanted).st_mtime < WANTED_FRESH
        except FileNotFoundError:
            return False

    def _want_room(self) -> None:
        try:
            os.utime(self._wanted)
        except FileNotFoundError:
            open(self._wanted, "a").close()

    def settle(self) -> None:
        """Withdraw this process's announcements and publish exactly its live pins (what others may not evict)."""
        with self._locked(), self._state:
            live = {k for k, n in self._pins.items() if n > 0}
            if self._announced or self._published != live:
                self._announced = set()
                self._publish()

    def _watch(self) -> None:
        """While this process publishes pins: settle them whenever someone waits for room (idle workers too)."""
        while True:
            time.sleep(self.poll)
            with self._state:
                if not self._published:
                    self._watcher = None
                    return
            if self.pressure():
                self.settle()

    def announce(self, keys: list[str]) -> None:
        """Keys this process will fetch soon: published as pins in one write, so pinning them later costs nothing.

        Other processes do not evict them meanwhile (they are about to be read). Unpins are lazy: the
        published set is a superset of the live pins until the next announcement rewrites it. While
        someone waits for room nothing is announced (see `settle`): those files are then found by `fetch`.
        """
        # an eviction runs wholly before (then lookup misses) or after (then it sees them)
        with self._locked(), self._state:
            self._announced = set() if self.pressure() else set(keys)
            self._publish()

    def lookup(self, key: str) -> str | None:
        """The cached path of an announced key, pinned, without taking the lock; None if it is not cached.

        Safe without the lock: nobody evicts an announced key once `announce` returned (see there).
        """
        final = self.path(key)
        with self._state:  # a concurrent `settle` withdraws the announcement wholly before or after this
            if key not in self._announced:
                return None
            try:
                os.utime(final)
            except FileNotFoundError:
                return None
            self._pins[key] += 1  # published already: it is announced
        return final

    def unpin(self, key: str) -> None:
        """This process no longer needs `key`: it may evict it (others may once the next announcement drops it,
        or at once while someone waits for room)."""
        with self._state:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]
                self._announced.discard(key)
            stale = key in self._published and key not in self._pins
        if stale and self.pressure():
            self.settle()

    def release_all(self) -> None:
        """Drop every pin and announcement of this process."""
        with self._locked(), self._state:
            self._pins.clear()
            self._announced = set()
            self._publish()

    def _pin(self, key: str) -> None:
        with self._state:
            self._pins[key] += 1
            if key not in self._published:
                self._publish()

    def fetch(
        self,
        url: str,
        size: int,
        version: str,
        open_fs: Callable[[], Any],
        needed_now: Callable[[], bool],
        stop: threading.Event | None = None,
    ) -> str:
        """A local path holding `url`, pinned for this process (call `unpin(key)` when done).

        Waits for space while `needed_now()` is false (a prefetch); the file needed next may
        go over the cap by itself when this process has no other download in flight and nothing else
        is over the cap, else it waits too, renewing `.wanted` so that others release what they can.
        """
        key = cache_key(url, size, version)
        final = self.path(key)
        part = ""
        waiting_since: float | None = None
        held = used = 0
        while not part:
            if stop is not None and stop.is_set():
                raise FetchCancelled(url)
            short = False  # waiting for room (not for another process's download of the same file)
            with self._locked():
                if os.path.exists(final):
                    os.utime(final)
                    self._pin(key)
                    return final
                data, parts, pinned = self._scan()
                if any(name.startswith(key + ".") for name in parts):
                    pass  # another process or thread is fetching it: wait for that copy
                else:
                    used = sum(s for s, _ in data.values()) + sum(parts.values())
                    free = shutil.disk_usage(self.directory).free
                    evictable = sorted((t, k, s) for k, (s, t) in data.items() if k not in pinned)

                    while not self._fits(used, free, size) and evictable:
                        _, victim, vsize = evictable.pop(0)
                        remove(self.path(victim))
                        used, free = used - vsize, free + vsize
                    with self._state:
                        alone = self._active == 0
                    head = needed_now() and alone
                    if head and free - size < self.min_free:
                        raise CacheFullError(
                            f"cannot cache {url} ({size} bytes) in {self.directory}: only {free} bytes free on "
                            f"that disk and the cache keeps at least {self.min_free} free; free some space, "
                            f"choose another cache_dir or lower min_free"
                        )
                    over_alone = head and (self.limit is None or used <= self.limit)  # the only file over the cap
                    short = not (self._fits(used, free, size) or over_alone)
                    held = sum(s for k, (s, _) in data.items() if k in pinned) + sum(parts.values())
                    if not short:
                        part = os.path.join(self.directory, "part", f"{key}.{os.getpid()}.{size}.part")
                        open(part, "wb").close()  # the reservation
                        with self._state:
                            self._active += 1
            if not part:
                if short and needed_now():
                    self._want_room()
                    waiting_since = waiting_since or time.monotonic()
                    if time.monotonic() - waiting_since > self.stall_report:
                        self._report_stall(url, size, used, held)
                        waiting_since = float("inf")  # once per file
                time.sleep(self.poll)
        try:
            self._download(url, size, part, open_fs)
            with self._locked():
                os.replace(part, final)
                self._pin(key)
        finally:
            remove(part)
            with self._state:
                self._active -= 1
        return final

    def _report_stall(self, url: str, size: int, used: int, held: int) -> None:
        print(
            f"air_magic: {url} ({size} bytes) has waited {self.stall_report:.0f} s for room in the cache at "
            f"{self.directory}: cache_limit={self.limit} bytes, {used} bytes cached or being fetched, {held} of them "
            f"pinned by live readers. Readers the DataLoader did not count hold them (another run sharing this "
            f"cache_dir, a plain torch DataLoader, ranks with more num_workers than this one): raise cache_limit, "
            f"give the other run its own cache_dir, or pass a transform",
            file=sys.stderr,
            flush=True,
        )

    def _fits(self, used: int, free: int, size: int) -> bool:
        cap_ok = self.limit is None or used + size <= self.limit
        return cap_ok and free - size >= self.min_free

    def _download(self, url: str, size: int, part: str, open_fs: Callable[[], Any]) -> None:
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * (2 ** (attempt - 1)) * (0.5 + random.random()))
            try:
                fs = open_fs()
                with fs.open(url, "rb", block_size=8 * 2**20) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 8 * 2**20)
                got = os.path.getsize(part)
                if got != size:
                    raise OSError(f"read {got} bytes, the listing said {size}: the file changed since it was listed")
                return
            except Exception as exc:  # noqa: BLE001 - any failure of the remote read is retried
                last = exc
        attempts = self.retries + 1
        raise OSError(f"could not read {url} after {attempts} attempts: {type(last).__name__}: {last}") from last
