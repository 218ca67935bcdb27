"""The supervisor's record of one call: its ranks' pids and exits, its store, its pool if hot, how it is stopped."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from ..come_back import Interrupt
from ..stopper import Stopper
from .pool import Pool


@dataclass
class Job:
    """One call's workers as the supervisor tracks them."""

    id: str
    world_size: int
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    exited: dict[int, int] = field(default_factory=dict)  # rank -> return code, once its process is gone
    reported: set[int] = field(default_factory=set)  # ranks whose RankExited was sent (may be before the exit)
    stopper: Stopper | None = None
    #: A session call being interrupted rather than stopped (StopJob.interrupt_after).
    interrupt: Interrupt | None = None
    #: Ranks of a session call that said they took it: their user code runs, where a SIGINT raises KeyboardInterrupt.
    took: set[int] = field(default_factory=set)
    pool: Pool | None = None
    store_pid: int | None = None
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    port: int = 0

    @property
    def live_workers(self) -> list[int]:
        return [pid for rank, pid in self.pids.items() if rank not in self.exited]
