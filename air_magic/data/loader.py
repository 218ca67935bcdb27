"""`DataLoader`: torch's DataLoader over a `StreamingFileDataset`, with a small state that resumes anywhere.

The state is five numbers and a string: epoch, files the whole job consumed in
that epoch, seed, number of files and a fingerprint of the listing. It counts
batches handed to the training loop (not what workers prefetched) and converts
them to positions of the epoch's global order, assuming ranks advance in
lockstep (as collective training does), so rank 0's state resumes every rank,
on any number of ranks and DataLoader workers.

Under a `cache_limit` it also checks, when made and at each iteration, that the
cache can hold the paths its workers keep pinned for batches in flight, and
refuses with the numbers and the ways out when it cannot.

Not for other datasets: a map-style dataset resumes with a sampler instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data

from .cache import human_size
from .dataset import StreamingFileDataset, _local_ranks, _rank_and_world
from .order import Plan

STATE_VERSION = 1


class DataLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A `torch.utils.data.DataLoader` with `state_dict()` / `load_state_dict()` and automatic epochs.

    Takes the same arguments as torch's. Each `iter(loader)` continues the current epoch from what
    the training loop already received; when an epoch ends the next iteration starts the next one.
    `set_epoch(e)` moves to the start of epoch `e` (calling it with the current epoch changes nothing,
    so `for epoch in range(start, n): loader.set_epoch(epoch)` resumes mid-epoch). Ranks may use
    different `num_workers`; fork, spawn and forkserver all work. `persistent_workers=True` is refused:
    persistent workers would keep the order of the epoch they started in. Under the dataset's
    `cache_limit`, a layout whose pinned paths cannot fit is refused here (see `_check_cache`).
    """

    def __init__(self, dataset: StreamingFileDataset, batch_size: int | None = 1, **kwargs: Any) -> None:
        if not isinstance(dataset, StreamingFileDataset):
            raise TypeError(
                f"air_magic.data.DataLoader reads a StreamingFileDataset (or UCVolumeDataset), got "
                f"{type(dataset).__name__}; use torch.utils.data.DataLoader for other datasets"
            )
        if kwargs.get("persistent_workers"):
            raise ValueError(
                "persistent_workers=True is not supported: each epoch's order and starting point reach the "
                "workers when they start; leave it False"
            )
        super().__init__(dataset, batch_size=batch_size, **kwargs)
        self._epoch = dataset.epoch
        self._start = dataset._start
        self._live: _Counted | None = None
        self._check_cache()

    def _keep(self) -> int:
        """Paths a reading process keeps pinned after yielding them.

        A worker: the batch in the loop's hands, the prefetch_factor batches queued, one more. Without
        workers: the batch being made and the one before (the loop is done with it when it asks for more).
        """
        chunk = 1 if self.batch_size is None else int(self.batch_size)
        return (int(self.prefetch_factor or 2) + 2) * chunk if self.num_workers else 2 * chunk

    def _check_cache(self) -> None:
        """Tell the dataset how many processes read into this machine's cache; refuse a cap their pins overflow."""
        dataset: StreamingFileDataset = self.dataset  # type: ignore[assignment]
        ranks, workers = _local_ranks(), int(self.num_workers)
        readers = ranks * max(1, workers)
        dataset.keep_yielded = self._keep()
        dataset._readers = readers
        need, budget = dataset.cache_plan(readers)
        limit = dataset.cache_limit
        if budget is None or limit is None or need <= limit:
            return
        chunk = 1 if self.batch_size is None else int(self.batch_size)
        if workers:
            who = f"{readers} reading processes ({ranks} ranks on this machine x {workers} DataLoader workers)"
            why = f"(prefetch_factor {int(self.prefetch_factor or 2)} + 2) x batch_size {chunk} = {self._keep()}"
            ways = "use fewer num_workers, a smaller prefetch_factor or a smaller batch_size"
        else:
            who = f"{readers} reading processes (the ranks on this machine, no DataLoader workers)"
            why = f"2 x batch_size {chunk} = {self._keep()}"
            ways = "use a smaller batch_size"
        raise ValueError(
            f"cache_limit={human_size(limit)} cannot hold the cached files this DataLoader keeps pinned: {who} "
            f"each keep the last {why} paths they handed out pinned until the training loop has opened them, "
            f"up to {human_size(need)} for the largest files. Raise cache_limit to at least {human_size(need)}; "
            f"or pass the dataset a transform (each file is then read in the worker and released at once); or {ways}"
        )

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        self._settle()
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning on the next iteration (no change if it is the current one)."""
        self._settle()
        if int(epoch) != self._epoch:
            self._epoch, self._start = int(epoch), 0
            self._retire()

    def _retire(self) -> None:
        """The live iterator, if any, stops: what comes next starts from (epoch, start)."""
        if self._live is not None:
            self._live.retired = True
            self._live = None

    def _settle(self) -> None:
        """Fold what the live iterator delivered into (epoch, start), and re-base its count there."""
        live = self._live
        if live is None:
            return
        plan = live.plan
        if live.finished or live.delivered_files() >= plan.rank_count():
            self._epoch, self._start = plan.epoch + 1, 0
            live.retired = True  # its epoch is over: it yields nothing more
            self._live = None
            return
        self._epoch, self._start = plan.epoch, plan.files_done(live.delivered_files())
        live.plan = Plan(plan.num_files, plan.epoch, self._start, plan.rank, plan.world_size, plan.split)
        live.batches = 0

    def __iter__(self) -> Any:  # type: ignore[override]  # torch's iterator, counted
        self._settle()
        self._retire()  # a new iteration continues from here; the old iterator stops
        dataset: StreamingFileDataset = self.dataset  # type: ignore[assignment]
        rank, world = _rank_and_world()
        dataset._layout = (rank, world)
        dataset.epoch, dataset._start = self._epoch, self._start
        chunk = 1 if self.batch_size is None else int(self.batch_size)
        dataset._chunk = chunk
        self._check_cache()  # the layout is known for sure now
        counted = _Counted(super().__iter__(), dataset.plan(), chunk)
        self._live = counted
        return counted

    def state_dict(self) -> dict[str, Any]:
        """Where the job is: epoch, files consumed in it by all ranks together, seed, listing fingerprint."""
        self._settle()
        dataset: StreamingFileDataset = self.dataset  # type: ignore[assignment]
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "files_done": self._start,
            "seed": dataset.seed,
            "num_files": len(dataset.listing),
            "fingerprint": dataset.listing.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (saved on any number of ranks and workers); a changed listing is an error."""
        dataset: StreamingFileDataset = self.dataset  # type: ignore[assignment]
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown DataLoader state version {state.get('version')!r}; expected {STATE_VERSION}")
        listing = dataset.listing
        if state["fingerprint"] != listing.fingerprint or state["num_files"] != len(listing):
            raise ValueError(
                f"the files under {listing.root} changed since this state was saved ({state['num_files']} files "
                f"then, {len(listing)} now, fingerprint {state['fingerprint']} then, {listing.fingerprint} now); "
                "resuming would skip or repeat files: restore the data, or start a new epoch with a fresh DataLoader"
            )
        if state["seed"] != dataset.seed:
            raise ValueError(
                f"this state was saved with seed={state['seed']}, the dataset has seed={dataset.seed}: "
                "the order would differ; build the dataset with the saved seed"
            )
        if not 0 <= int(state["files_done"]) <= len(listing):
            raise ValueError(f"files_done={state['files_done']} is outside 0..{len(listing)}")
        self._retire()
        self._epoch, self._start = int(state["epoch"]), int(state["files_done"])


class _Counted:
    """The DataLoader's iterator, counting the batches that reached the training loop."""

    def __init__(self, inner: Iterator[Any], plan: Plan, chunk: int) -> None:
        self.inner = inner
        self.plan = plan
        self.chunk = chunk
        self.batches = 0
        self.finished = False
        self.retired = False

    def delivered_files(self) -> int:
        return min(self.batches * self.chunk, self.plan.rank_count())

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        if self.retired or self.finished:
            raise StopIteration
        try:
            batch = next(self.inner)
        except StopIteration:
            self.finished = True
            raise
        self.batches += 1
        return batch

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]
