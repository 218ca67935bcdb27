"""air_magic.data's FileCache as a plain object: what it may hold over its cap, and what it publishes as pinned."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import fsspec
import pytest

from air_magic.data.cache import FileCache, cache_key, cache_need, human_size

SIZE = 1000


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    """Six local files of SIZE bytes standing in for remote ones."""
    paths = []
    for i in range(6):
        path = tmp_path / "src" / f"f{i}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(bytes([i]) * SIZE)
        paths.append(str(path))
    return paths


def fetch(cache: FileCache, url: str, stop: threading.Event | None = None) -> str:
    """The file this process needs next, through the cache."""
    return cache.fetch(url, SIZE, "v1", lambda: fsspec.filesystem("file"), lambda: True, stop)


def key(url: str) -> str:
    return cache_key(url, SIZE, "v1")


def published(cache: FileCache) -> set[str]:
    """The keys this process's pins file lists (what other processes may not evict)."""
    path = os.path.join(cache.directory, "pins", str(os.getpid()))
    return set(Path(path).read_text().split()) if os.path.exists(path) else set()


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_need_is_the_largest_files_that_the_readers_keep_each_counted_once():
    """The pinned paths of 2 readers keeping 2 files each may be the 4 largest files, and never more than all of
    them."""
    sizes = [5, 1, 9, 3, 7, 2]
    assert cache_need(sizes, readers=2, keep=2) == 9 + 7 + 5 + 3
    assert cache_need(sizes, readers=4, keep=8) == sum(sizes)
    assert cache_need(sizes, readers=4, keep=0) == 0
    assert human_size(8 * 2**20) == "8388608 bytes (8.0 MiB)"
    assert human_size(999) == "999 bytes"


def test_the_file_needed_next_goes_over_the_cap_only_while_nothing_else_is_over(
    files: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
):
    """With every cached file pinned, one needed file may go over a 2-file cap; the next one waits (asking others for
    room, and saying so on stderr when it lasts) until a file is released."""
    cache = FileCache(str(tmp_path / "cache"), limit=2 * SIZE, min_free=0, poll=0.005, stall_report=0.05)
    for url in files[:3]:
        fetch(cache, url)
    assert cache.usage() == 3 * SIZE  # the third went over the cap by itself
    got: list[str] = []
    stop = threading.Event()
    waiter = threading.Thread(target=lambda: got.append(fetch(cache, files[3], stop)))
    waiter.start()
    try:
        assert wait_for(cache.pressure), "a needed file waiting for room does not say so"
        said: list[str] = []  # stderr so far: on a busy machine the waiting thread may take long to report

        def reported() -> bool:
            said.append(capsys.readouterr().err)
            return "has waited" in "".join(said)

        assert wait_for(reported), "a file that waits long for room does not say so on stderr"
        assert not got and cache.usage() == 3 * SIZE, "a second file went over the cap"
        cache.unpin(key(files[0]))
        waiter.join(10)
        assert got == [cache.path(key(files[3]))]
        assert cache.usage() == 3 * SIZE
        err = "".join(said) + capsys.readouterr().err
        assert (
            err.count("has waited") == 1
            and "cache_limit=2000 bytes, 3000 bytes cached or being fetched, 3000 of them pinned" in err
        ), err
        assert not os.path.exists(cache.path(key(files[0]))), "the released file was not the one evicted"
    finally:
        stop.set()
        waiter.join()


def test_a_prefetch_never_goes_over_the_cap(files: list[str], tmp_path: Path):
    """A download that is not needed yet waits for room instead of going over the cap, and gives up when told to."""
    cache = FileCache(str(tmp_path / "cache"), limit=2 * SIZE, min_free=0, poll=0.005)
    for url in files[:2]:
        fetch(cache, url)
    stop = threading.Event()
    errors: list[BaseException] = []

    def prefetch() -> None:
        try:
            cache.fetch(files[2], SIZE, "v1", lambda: fsspec.filesystem("file"), lambda: False, stop)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=prefetch)
    thread.start()
    time.sleep(0.1)
    assert cache.usage() == 2 * SIZE and not cache.pressure()
    stop.set()
    thread.join(10)
    assert [type(e).__name__ for e in errors] == ["FetchCancelled"]


def test_while_someone_waits_for_room_only_live_pins_are_published(files: list[str], tmp_path: Path):
    """Announced files and lazily released ones stop being protected once a process waits for room: settled at once on
    unpin, and by the watcher thread when idle."""
    cache = FileCache(str(tmp_path / "cache"), limit=None, min_free=0, poll=0.005)
    for url in files[:3]:
        fetch(cache, url)
    cache.unpin(key(files[0]))
    cache.announce([key(u) for u in files[:5]])
    assert published(cache) == {key(u) for u in files[:5]}
    assert cache.lookup(key(files[0])) == cache.path(key(files[0]))  # announced and cached: found without the lock
    cache.unpin(key(files[0]))
    assert key(files[0]) in published(cache), "without pressure an unpin is published lazily"

    wanted = Path(cache.directory, ".wanted")
    wanted.touch()  # another process waits for room (and renews the mark while it does)
    assert wait_for(lambda: published(cache) == {key(files[1]), key(files[2])}), published(cache)
    assert cache.lookup(key(files[3])) is None  # no longer announced: found through fetch, under the lock
    wanted.touch()
    cache.announce([key(u) for u in files])
    assert published(cache) == {key(files[1]), key(files[2])}, "announced while someone waits for room"
    wanted.touch()
    cache.unpin(key(files[1]))
    assert published(cache) == {key(files[2])}
    cache.release_all()
    assert published(cache) == set()
    assert wait_for(lambda: cache._watcher is None), "the watcher outlived the pins"
