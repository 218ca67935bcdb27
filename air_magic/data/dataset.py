"""`StreamingFileDataset`: every file under a directory or fsspec URL, once per epoch, in one seeded order.

The listing is taken once, in the process that builds the dataset, and travels
with it to ranks and DataLoader workers (fork or spawn alike). Each process
reads only its own share (see `order.py`); local files are yielded in place,
remote ones through the private cache (see `cache.py`) with a few downloads
running ahead of the file being yielded.

Under a `cache_limit`, what each reading process holds must fit: its last
`keep_yielded` paths (kept pinned until the training loop opens them; none with
a `transform`) for every process on the machine, checked before reading, and
files fetched ahead only within that process's share of what is left.

Not for saving the reading position: `loader.DataLoader` counts what reached
the training loop and tells the dataset where to start.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from .cache import FileCache, cache_key, cache_need, human_size
from .order import SPLITS, Plan, worker_share
from .source import Listing, filesystem, list_files, parse_size


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/air_magic/data` (or `~/.cache/...`): private to the user."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "air_magic", "data")


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _local_ranks() -> int:
    """Ranks on this machine (they share its cache directory): LOCAL_WORLD_SIZE where the launcher set it."""
    world = _rank_and_world()[1]
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return min(world, max(1, int(local))) if local.isdigit() else world


def _min_free(value: int | str | None, directory: str) -> int:
    """Bytes to keep free on the cache's disk: a size, or a share of the disk such as "5%"."""
    if value is None or value == 0:
        return 0
    if isinstance(value, str) and value.strip().endswith("%"):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        return int(shutil.disk_usage(directory).total * float(value.strip()[:-1]) / 100)
    return parse_size(value) or 0


class StreamingFileDataset(IterableDataset[Any]):
    """The files under `path` (a directory or any fsspec URL), each exactly once per epoch.

    path: a local directory, `file://...`, `s3://bucket/prefix`, `gs://...` (with its fsspec backend installed).
    pattern: keep only files whose name relative to `path` matches this glob (`*` also matches `/`).
    recursive: list subdirectories too.
    transform: called on the local path of each file; its result is yielded (default: the path itself).
    shuffle, seed: a seeded shuffle per epoch, one global order whatever the number of ranks and workers.
    split: when the files do not divide evenly over the ranks: "pad" (default; the last positions repeat
        the first files of the epoch so every rank reads as many, as DistributedSampler does), "drop" (the
        last `n % world_size` files of the epoch's order are skipped) or "uneven" (every file exactly once;
        ranks may differ by one file, which a collective training loop must allow for).
    cache_dir, cache_limit: where remote files are cached (made mode 0700) and at most how many bytes
        (an int or "10GB"; None = no cap); a cap smaller than the largest file is an error here.
    min_free: free disk space the cache always leaves (bytes, "20GB" or a share such as "5%").
    prefetch: remote files each process fetches ahead of the one it yields.
    retries, backoff: remote reads are retried this many times, waiting backoff * 2**n seconds.
    keep_yielded: cached files a process keeps pinned after yielding them without a transform, so a
        prefetched batch of paths is not evicted before the training loop opens it (the DataLoader
        of this package sets it from its batch size and prefetch_factor). Under a cache_limit, those
        of every reading process on the machine must fit in it: iterating fails at once otherwise.
    storage_options: passed to fsspec (credentials, endpoint).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        pattern: str | None = None,
        recursive: bool = False,
        transform: Callable[[str], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        split: str = "pad",
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        min_free: int | str | None = "5%",
        prefetch: int = 8,
        retries: int = 5,
        backoff: float = 0.5,
        keep_yielded: int = 16,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.listing: Listing = list_files(path, pattern, recursive, storage_options)
        self.transform = transform
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.split = split
        self.prefetch = max(0, int(prefetch))
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.keep_yielded = max(0, int(keep_yielded))
        self.cache_dir = os.path.abspath(os.fspath(cache_dir)) if cache_dir is not None else default_cache_dir()
        self.cache_limit = parse_size(cache_limit)
        self.min_free = 0 if self.listing.local else _min_free(min_free, self.cache_dir)
        if not self.listing.local and self.cache_limit is not None:
            largest = max(self.listing.sizes)
            if largest > self.cache_limit:
                name = self.listing.names[self.listing.sizes.index(largest)]
                raise ValueError(
                    f"cache_limit={self.cache_limit} bytes is smaller than the largest file, {name} "
                    f"({largest} bytes); raise cache_limit to at least that"
                )
        self.epoch = 0
        self._start = 0  # positions of this epoch the job already consumed (set by the DataLoader on resume)
        self._chunk = 1  # files per DataLoader batch: the unit dealt to workers
        self._layout: tuple[int, int] | None = None  # (rank, world) fixed by the DataLoader, else detected
        self._cache: FileCache | None = None
        self._cache_pid = -1
        self._keys: dict[int, str] = {}
        self._readers: int | None = None  # processes reading into this machine's cache (set by the DataLoader)

    # -- order ---------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch`'s order from its start on the next iteration."""
        self.epoch, self._start = int(epoch), 0

    def plan(self, rank: int | None = None, world_size: int | None = None) -> Plan:
        """What `rank` reads in the rest of the current epoch."""
        r, w = self._layout or _rank_and_world()
        return Plan(
            len(self.listing),
            self.epoch,
            self._start,
            r if rank is None else rank,
            w if world_size is None else world_size,
            self.split,
            self.seed,
            self.shuffle,
        )

    def __len__(self) -> int:
        """Files this rank reads in the rest of the current epoch."""
        return self.plan().rank_count()

    # -- reading -------------------------------------------------------------------------------
    def _file_cache(self) -> FileCache:
        if self._cache is None or self._cache_pid != os.getpid():
            self._cache = FileCache(self.cache_dir, self.cache_limit, self.min_free, self.retries, self.backoff)
            self._cache_pid = os.getpid()
        return self._cache

    def cache_plan(self, readers: int) -> tuple[int, int | None]:
        """(bytes the pinned paths of `readers` processes may hold, bytes each may fetch ahead; None: no cap)."""
        keep = 0 if self.transform is not None else self.keep_yielded
        need = cache_need(self.listing.sizes, readers, keep)
        if self.cache_limit is None or self.listing.local:
            return need, None
        return need, max(0, self.cache_limit - need) // max(1, readers)

    def _ahead_budget(self) -> int | None:
        """Bytes this process may fetch ahead of the file it yields; an error if the cap cannot hold the pins."""
        readers = self._readers or _local_ranks()
        need, budget = self.cache_plan(readers)
        if budget is not None and self.cache_limit is not None and need > self.cache_limit:
            raise ValueError(
                f"cache_limit={human_size(self.cache_limit)} cannot hold the files this dataset keeps pinned: "
                f"{readers} reading processes on this machine each keep the last keep_yielded={self.keep_yielded} "
                f"paths they yielded pinned until they are opened, up to {human_size(need)} for the largest files. "
                f"Raise cache_limit to at least {human_size(need)}, pass a transform (each file is then read "
                f"where it was fetched and released at once) or lower keep_yielded"
            )
        return budget

    def __iter__(self) -> Iterator[Any]:
        files = self.plan().rank_files()
        info = get_worker_info()
        if info is not None:
            files = [files[j] for j in worker_share(len(files), self._chunk, info.num_workers, info.id)]
        if self.listing.local:
            for index in files:
                path = self.listing.url(index)
                yield path if self.transform is None else self.transform(path)
        else:
            yield from self._iter_remote(files)

    def _iter_remote(self, files: list[int]) -> Iterator[Any]:
        budget = self._ahead_budget()
        cache = self._file_cache()
        listing = self.listing
        fs_holder: dict[int, Any] = {}

        def open_fs() -> Any:
            if os.getpid() not in fs_holder:
                fs_holder.clear()
                fs_holder[os.getpid()] = filesystem(listing.protocol, listing.storage_options)
            return fs_holder[os.getpid()]

        head = [0]  # position in `files` of the file to yield next
        stop = threading.Event()

        def fetch(pos: int) -> str:
            index = files[pos]
            return cache.fetch(
                listing.url(index), listing.sizes[index], listing.versions[index], open_fs, lambda: head[0] >= pos, stop
            )

        known = self._keys  # computed once per process and file, reused by later epochs
        for i in files:
            if i not in known:
                known[i] = cache_key(listing.url(i), listing.sizes[i], listing.versions[i])
        keys = [known[i] for i in files]

        sizes = [listing.sizes[i] for i in files]
        yielded: deque[str] = deque()
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.prefetch, 16)), thread_name_prefix="air-magic-fetch")
        pending: deque[Future[str] | str] = deque()
        finished = False
        try:
            submitted = 0
            window = 64 + self.prefetch
            for pos in range(len(files)):
                head[0] = pos
                if pos % 64 == 0:  # publish the next files as pinned in one write (see FileCache.announce)
                    cache.announce(keys[pos : pos + window] + list(yielded))
                ahead = sum(sizes[pos + 1 : submitted])  # fetched or fetching ahead of this one, held meanwhile
                while submitted < len(files) and submitted <= pos + self.prefetch:
                    if submitted > pos and budget is not None and ahead + sizes[submitted] > budget:
                        break  # this process's share of the cap is taken: fetch further when the head moves
                    hit = cache.lookup(keys[submitted])  # a cached file needs no thread
                    pending.append(hit if hit is not None else pool.submit(fetch, submitted))
                    ahead += sizes[submitted] if submitted > pos else 0
                    submitted += 1
                first = pending.popleft()
                local = first if isinstance(first, str) else first.result()
                key = os.path.basename(local)
                if self.transform is not None:
                    try:
                        item = self.transform(local)
                    finally:
                        cache.unpin(key)
                    yield item
                else:
                    yielded.append(key)
                    while len(yielded) > self.keep_yielded:
                        cache.unpin(yielded.popleft())
                    yield local
            finished = True
        finally:
            stop.set()  # fetches still waiting for space give up
            for fut in pending:
                if not isinstance(fut, str):
                    fut.cancel()
            pool.shutdown(wait=True)
            for fut in pending:  # fetched ahead but never yielded
                if isinstance(fut, str):
                    cache.unpin(os.path.basename(fut))
                elif fut.done() and not fut.cancelled() and fut.exception() is None:
                    cache.unpin(os.path.basename(fut.result()))
            if not (finished and get_worker_info() is not None):
                for key in yielded:  # a DataLoader worker's last batches may still be queued: kept while it lives
                    cache.unpin(key)
            cache.announce([])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"], state["_cache_pid"] = None, -1
        return state
