"""air_magic.data reading from a real S3 API (moto on 127.0.0.1) through its private, byte-capped cache."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import pytest
from helpers import ROOT, wait_until
from s3_server import S3

from air_magic.data import DataLoader, StreamingFileDataset
from air_magic.data.cache import CacheFullError, FileCache

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow

KIB = 1024


def make_files(root: Path, n: int, size: int) -> dict[str, str]:
    """n files of `size` distinct bytes under root; returns name -> sha256."""
    root.mkdir(parents=True, exist_ok=True)
    digests = {}
    for i in range(n):
        data = hashlib.sha256(str(i).encode()).digest() * (size // 32)
        (root / f"f{i:03d}.bin").write_bytes(data)
        digests[f"f{i:03d}.bin"] = hashlib.sha256(data).hexdigest()
    return digests


def digest(path: str) -> tuple[str, str]:
    """A transform: (file's base name without the cache prefix, sha256 of its bytes)."""
    with open(path, "rb") as f:
        return os.path.basename(path).split("-", 1)[-1], hashlib.sha256(f.read()).hexdigest()


def slow_digest(path: str) -> tuple[str, str]:
    """`digest`, slowly enough for downloads to run ahead of it."""
    time.sleep(0.01)
    return digest(path)


@pytest.fixture
def remote(s3: S3, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """An S3 prefix holding 24 files of 16 KiB, and their digests."""
    digests = make_files(tmp_path / "src", 24, 16 * KIB)
    url = f"s3://{s3.bucket()}/data"
    s3.upload(tmp_path / "src", url)
    return url, digests


def test_s3_dataset_matches_local_and_a_warm_epoch_reads_only_the_cache(remote, s3: S3, tmp_path: Path):
    """Same order and bytes as the local copy; the cache directory is private; epoch 2 needs nothing from S3."""
    url, digests = remote
    cache = tmp_path / "cache"
    ds = StreamingFileDataset(url, seed=4, transform=digest, cache_dir=cache)
    local = StreamingFileDataset(tmp_path / "src", seed=4, transform=digest)
    first = list(ds)
    assert first == list(local)
    assert dict(first) == digests
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    s3.fs().rm(url, recursive=True)  # the cache alone must serve the next epoch
    ds.set_epoch(1)
    assert sorted(ds) == sorted(first)


SAMPLER = """
import fcntl, os, sys, time
cache = sys.argv[1]
peak = 0
while True:
    time.sleep(0.001)
    if not os.path.exists(os.path.join(cache, ".lock")):
        continue
    fd = os.open(os.path.join(cache, ".lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        total = 0
        for sub in ("data", "part"):
            for entry in os.scandir(os.path.join(cache, sub)):
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:  # a failed download, removed without the lock
                    pass
    finally:
        os.close(fd)
    if total > peak:
        peak = total
        print(peak, flush=True)
"""


class CachePeak:
    """Samples the bytes under a cache directory (complete files and downloads); `peak` is the most seen.

    Each sample holds the cache's lock, so no eviction or new download interleaves with the scan. The
    sampler is a process of its own: a lock held by a thread here would be shared by the DataLoader
    workers this process forks.
    """

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.peak = 0

    def __enter__(self) -> Self:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", SAMPLER, str(self.cache)], stdout=subprocess.PIPE, text=True
        )
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.05)  # a last sample
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=30)
        self.peak = max([0, *(int(line) for line in out.split())])


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_cache_peak_stays_within_the_limit_plus_one_file_per_worker(s3: S3, tmp_path: Path):
    """Iterating 40 files of 64 KiB with a 256 KiB cap and 3 workers prefetching, the cache never holds more than 256 +
    64 KiB."""
    digests = make_files(tmp_path / "src", 40, 64 * KIB)
    url = f"s3://{s3.bucket()}/big"
    s3.upload(tmp_path / "src", url)
    cache = tmp_path / "cache"
    limit, workers = 256 * KIB, 3
    ds = StreamingFileDataset(url, transform=slow_digest, cache_dir=cache, cache_limit=limit, prefetch=4)
    with CachePeak(cache) as peak:
        seen = [pair for batch in DataLoader(ds, batch_size=4, num_workers=workers) for pair in zip(*batch)]
    assert sorted(seen) == sorted(digests.items())
    assert 0 < peak.peak <= limit + 64 * KIB, f"peak {peak.peak} bytes"


def two_ranks_read_paths(
    url: str,
    cache: Path,
    limit: int,
    monkeypatch: pytest.MonkeyPatch,
    transform=None,
    prefetch_factor: int = 2,
) -> list[tuple[str, str]]:
    """2 ranks x 2 DataLoader workers, batch size 2, stepped in lockstep from this process; (name, sha256) of every file
    the loop got."""
    loaders = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ds = StreamingFileDataset(url, seed=1, transform=transform, cache_dir=cache, cache_limit=limit)
        loaders.append(DataLoader(ds, batch_size=2, num_workers=2, prefetch_factor=prefetch_factor))
    iters = []
    for rank, loader in enumerate(loaders):
        monkeypatch.setenv("RANK", str(rank))
        iters.append(iter(loader))
    seen = []
    for batches in zip(*iters):
        time.sleep(0.01)  # the training step: workers fetch and evict meanwhile
        for batch in batches:
            seen += list(zip(*batch)) if transform is not None else [digest(path) for path in batch]
    return seen


@pytest.fixture
def quarter_mib_files(s3: S3, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """40 files of 256 KiB on S3, and their digests."""
    digests = make_files(tmp_path / "src", 40, 256 * KIB)
    url = f"s3://{s3.bucket()}/quarter"
    s3.upload(tmp_path / "src", url)
    return url, digests


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_pinned_paths_under_a_cap_too_small_for_them_are_refused_when_the_dataloader_is_made(
    quarter_mib_files,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """2 ranks x 2 workers handing out paths pin 32 files of 256 KiB: a 2 MiB cap is refused up front, with the numbers
    and the ways out (also without workers, and iterating the bare dataset)."""
    url, _ = quarter_mib_files
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = StreamingFileDataset(url, cache_dir=tmp_path / "cache", cache_limit="2MiB")
    with pytest.raises(ValueError) as err:
        DataLoader(ds, batch_size=2, num_workers=2)
    message = str(err.value)
    for part in (
        "cache_limit=2097152 bytes (2.0 MiB)",
        "4 reading processes (2 ranks on this machine x 2 DataLoader workers)",
        "(prefetch_factor 2 + 2) x batch_size 2 = 8",
        "8388608 bytes (8.0 MiB)",
        "transform",
        "num_workers",
        "prefetch_factor",
    ):
        assert part in message, message
    with_transform = StreamingFileDataset(url, transform=digest, cache_dir=tmp_path / "cache", cache_limit="2MiB")
    DataLoader(with_transform, batch_size=2, num_workers=2)  # read in the worker, released at once: it fits
    with pytest.raises(
        ValueError,
        match=r"2 reading processes \(the ranks on this machine, no DataLoader workers\) "
        r"each keep the last 2 x batch_size 8 = 16 paths",
    ):
        DataLoader(ds, batch_size=8)
    with pytest.raises(
        ValueError,
        match=r"2 reading processes on this machine each keep the last keep_yielded=16 .* "
        r"up to 8388608 bytes \(8.0 MiB\).* lower keep_yielded",
    ):
        next(iter(StreamingFileDataset(url, cache_dir=tmp_path / "cache", cache_limit="2MiB")))


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_paths_from_two_ranks_and_two_workers_each_stay_within_the_cap(
    quarter_mib_files,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """2 ranks x 2 workers (prefetch_factor 1) handing out paths of 40 files of 256 KiB under a 6.5 MiB cap: the cache
    never holds more than the cap plus one file, and every file reaches the loop once, still readable."""
    url, digests = quarter_mib_files
    cache, limit = tmp_path / "cache", 6 * 2**20 + 512 * KIB
    with CachePeak(cache) as peak:
        seen = two_ranks_read_paths(url, cache, limit, monkeypatch, prefetch_factor=1)
    assert sorted(seen) == sorted(digests.items())
    assert 0 < peak.peak <= limit + 256 * KIB, f"peak {peak.peak} bytes"
    assert len(list((cache / "data").iterdir())) < 40, "nothing was evicted: the cap did not bite"


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_a_transform_reads_through_a_small_cap_from_two_ranks_and_two_workers_each(
    quarter_mib_files,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """With a transform, the measured layout (2 ranks x 2 workers, batch 2, 40 x 256 KiB) reads every file once under a
    2 MiB cap, never above it plus one file."""
    url, digests = quarter_mib_files
    cache, limit = tmp_path / "cache", 2 * 2**20
    with CachePeak(cache) as peak:
        seen = two_ranks_read_paths(url, cache, limit, monkeypatch, transform=digest)
    assert sorted(seen) == sorted(digests.items())
    assert 0 < peak.peak <= limit + 256 * KIB, f"peak {peak.peak} bytes"


def test_cache_limit_smaller_than_the_largest_file_is_an_error_at_once(remote, tmp_path: Path):
    """A cap below the largest file fails when the dataset is made, naming the file, instead of waiting forever."""
    url, _ = remote
    with pytest.raises(
        ValueError, match=r"cache_limit=10000 bytes is smaller than the largest file, f000.bin \(16384 bytes\)"
    ):
        StreamingFileDataset(url, cache_dir=tmp_path / "c", cache_limit="10KB")


def test_remote_read_is_retried_then_fails_naming_the_url(remote, s3: S3, tmp_path: Path):
    """A file gone after listing is retried with backoff, then the error names its URL and the attempts."""
    url, _ = remote
    ds = StreamingFileDataset(url, shuffle=False, cache_dir=tmp_path / "c", retries=2, backoff=0.01, prefetch=0)
    s3.fs().rm(f"{url}/f003.bin")
    with pytest.raises(OSError, match=rf"could not read {url}/f003.bin after 3 attempts"):
        list(ds)


READER = """
import hashlib, json, os, sys, time
from air_magic.data import DataLoader, StreamingFileDataset

url, cache, expected = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
delay, workers = float(sys.argv[4]), int(sys.argv[5])

def check(path):
    time.sleep(delay)
    with open(path, "rb") as f:
        return os.path.basename(path).split("-", 1)[-1], hashlib.sha256(f.read()).hexdigest()

if __name__ == "__main__":
    ds = StreamingFileDataset(url, transform=check, cache_dir=cache, cache_limit=6 * 16384, prefetch=3)
    n = 0
    for names, digests in DataLoader(ds, batch_size=2, num_workers=workers):
        for name, d in zip(names, digests):
            assert expected[name] == d, name
            n += 1
            print("read", name, flush=True)
    assert n == len(expected), n
    print("OK", n, flush=True)
"""


def test_sigkill_mid_epoch_then_the_same_cache_serves_two_concurrent_runs(remote, tmp_path: Path):
    """A reader killed with SIGKILL mid-epoch leaves a cache that the next run uses, and two runs sharing it at once
    both read correct bytes."""
    url, digests = remote
    script, expected, cache = tmp_path / "reader.py", tmp_path / "expected.json", tmp_path / "cache"
    script.write_text(READER)
    expected.write_text(json.dumps(digests))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def start(delay: float, workers: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(script), url, str(cache), str(expected), str(delay), str(workers)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )

    victim = start(0.1, 2)  # killed with its DataLoader workers, mid-epoch
    try:
        assert victim.stdout is not None
        reads = 0
        for line in victim.stdout:  # other lines (warnings) may come first
            reads += line.startswith("read")
            if reads == 4:
                break
        assert reads == 4, "the reader did not start reading"
    finally:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        victim.stdout.close()  # type: ignore[union-attr]
    runs = [start(0.0, 0), start(0.0, 0)]
    outputs = [run.communicate(timeout=120)[0] for run in runs]
    for run, out in zip(runs, outputs):
        assert run.returncode == 0 and f"OK {len(digests)}" in out, out
    assert list((cache / "part").iterdir()) == []


def test_free_disk_floor_is_kept(remote, tmp_path: Path):
    """A floor of free disk that cannot be kept fails the read, saying how much is free and what to change."""
    url, _ = remote
    ds = StreamingFileDataset(url, cache_dir=tmp_path / "c", min_free="100%", prefetch=0)
    with pytest.raises(CacheFullError, match=r"bytes free on that disk and the cache keeps at least .* lower min_free"):
        next(iter(ds))


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_yielded_paths_stay_until_the_training_loop_opens_them(s3: S3, tmp_path: Path):
    """Without a transform, every path a DataLoader hands over (after prefetching) still holds its file, under a cap
    that forces eviction."""
    digests = make_files(tmp_path / "src", 100, 8 * KIB)
    url = f"s3://{s3.bucket()}/paths"
    s3.upload(tmp_path / "src", url)
    cache = tmp_path / "cache"
    ds = StreamingFileDataset(url, cache_dir=cache, cache_limit=50 * 8 * KIB, prefetch=4)
    seen = []
    for batch in DataLoader(ds, batch_size=4, num_workers=2, prefetch_factor=2):
        time.sleep(0.005)  # the training step: workers fetch and evict meanwhile
        seen += [digest(path) for path in batch]
    assert sorted(seen) == sorted(digests.items())
    assert len(list((cache / "data").iterdir())) < 100, "nothing was evicted: the cap did not bite"


def test_a_child_forked_while_the_lock_is_held_does_not_keep_it(tmp_path: Path):
    """A process forked while one of our threads holds the cache's lock (a DataLoader starting workers) does not keep
    the lock after the parent lets go."""
    import fcntl

    cache = FileCache(str(tmp_path / "cache"), limit=None, min_free=0)
    with cache._locked():
        child = os.fork()
        if child == 0:  # the child lives on, as a DataLoader worker would
            time.sleep(30)
            os._exit(0)

    def free() -> bool:
        fd = os.open(os.path.join(cache.directory, ".lock"), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    try:
        wait_until(free, 30, "the forked child still holds the cache's lock", step=0.01)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
