"""Which file each rank and DataLoader worker reads, and in which order.

One global order per epoch (a seeded shuffle of the listing, or the listing
itself) is laid out over ranks by position: position `p` of the part of the
epoch still to read goes to rank `p % world_size`. A rank's own stream is then
cut into batch-sized chunks dealt round-robin to its DataLoader workers, which
is the order in which `torch.utils.data.DataLoader` hands batches back. So the
files that reached the training loop after `k` batches on every rank are
exactly the first positions of the global order, whatever the number of ranks
or workers: that is what makes the saved state small and layout-free.

This module is pure arithmetic: no I/O, no torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Split = Literal["pad", "drop", "uneven"]
SPLITS: tuple[str, ...] = ("pad", "drop", "uneven")


def epoch_order(num_files: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Indices into the sorted listing, in the order epoch `epoch` reads them (the same in every process)."""
    order = list(range(num_files))
    if shuffle:
        random.Random((int(seed) << 32) ^ int(epoch)).shuffle(order)
    return order


@dataclass(frozen=True)
class Plan:
    """What one rank reads in one epoch, starting after `start` positions the whole job already consumed."""

    num_files: int
    epoch: int
    start: int
    rank: int
    world_size: int
    split: str = "pad"
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.start <= self.num_files:
            raise ValueError(f"start {self.start} is outside 0..{self.num_files}")

    @property
    def remaining(self) -> int:
        """Positions of the global order not yet consumed by the job."""
        return self.num_files - self.start

    def rank_count(self, rank: int | None = None) -> int:
        """How many files `rank` (default: this plan's rank) reads in the rest of the epoch."""
        r = self.rank if rank is None else rank
        rest, w = self.remaining, self.world_size
        if self.split == "pad":
            return -(-rest // w)
        if self.split == "drop":
            return rest // w
        return max(0, -(-(rest - r) // w))

    def rank_positions(self) -> list[int]:
        """Positions in the global order this rank reads, in order (padding wraps to the start of the order)."""
        w = self.world_size
        return [self.start + self.rank + w * j for j in range(self.rank_count())]

    def rank_files(self) -> list[int]:
        """Listing indices this rank reads, in order."""
        order = epoch_order(self.num_files, self.seed, self.epoch, self.shuffle)
        n = self.num_files
        return [order[p] if p < n else order[(p - n) % n] for p in self.rank_positions()]

    def files_done(self, delivered: int) -> int:
        """Positions the whole job consumed once every rank delivered `delivered` files (ranks in lockstep)."""
        return min(self.num_files, self.start + delivered * self.world_size)


def worker_share(count: int, chunk: int, num_workers: int, worker: int) -> list[int]:
    """Indices (0..count-1) of a rank's stream that DataLoader worker `worker` produces, in order.

    Chunk `i` (of `chunk` consecutive files, one batch) goes to worker `i % num_workers`:
    the DataLoader asks its workers for batches round-robin, so the batches come back in stream order.
    """
    chunk = max(1, chunk)
    num_workers = max(1, num_workers)
    return [j for j in range(count) if (j // chunk) % num_workers == worker]
