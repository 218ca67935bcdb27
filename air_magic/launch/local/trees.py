"""Finding every process of a job: its workers, their descendants, and the orphans the supervisor adopted.

The supervisor is a child subreaper, so what a worker leaves behind is re-parented
to it; such an orphan is still the job's when it carries the job's AIR_MAGIC_JOB
variable, or, carrying none, when it was born while the job ran. Stopping them is
the stopper's job (stopper.py); this module only finds them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from ..stopper import Stopper

if TYPE_CHECKING:
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
    pool: Pool | None = None
    store_pid: int | None = None
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    port: int = 0

    @property
    def live_workers(self) -> list[int]:
        return [pid for rank, pid in self.pids.items() if rank not in self.exited]


def live_trees(pids: Iterable[int]) -> list[psutil.Process]:
    """Each of `pids` that is running (not a zombie), with all its descendants."""
    found: list[psutil.Process] = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            pass
    return found


def job_processes(job: Job, known: set[int]) -> dict[int, psutil.Process]:
    """Every live process of `job`; `known`: children of the supervisor that belong to others (workers, stores)."""
    found: dict[int, psutil.Process] = {}
    for pid in job.live_workers:
        try:
            proc = psutil.Process(pid)
            found[pid] = proc
            found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.Error:
            pass
    try:
        mine = psutil.Process().children(recursive=True)
    except psutil.Error:
        mine = []
    me = os.getpid()
    for c in mine:
        if c.pid in found or c.pid in known:
            continue
        try:
            tag = c.environ().get("AIR_MAGIC_JOB")
            if tag == job.id or c.pid in job.seen:
                found[c.pid] = c
            elif tag is None and c.ppid() == me and c.create_time() >= job.started - 1:
                # An orphan we adopted that carries no job tag: it dropped its environment (env={}), or
                # it was forked from a warm worker, whose /proc environ is ours. Only a job running
                # when it was born can have started it, so each such job counts it as its own.
                found[c.pid] = c
                found.update((d.pid, d) for d in c.children(recursive=True))
        except psutil.Error:
            pass
    for pid, proc in list(found.items()):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                del found[pid]
        except psutil.Error:
            del found[pid]
    job.seen.update(found)
    return found
