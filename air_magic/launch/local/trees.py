"""Finding every process of a job: its workers, their descendants, and the orphans the supervisor adopted.

The supervisor is a child subreaper, so what a worker leaves behind is re-parented
to it; such an orphan is still the job's when it carries the job's AIR_MAGIC_JOB
variable, or, carrying none, when it was born while the job ran. Stopping them is
the stopper's job (stopper.py); this module only finds them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import psutil

from ...envvars import JOB


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


def job_processes(
    job: str, workers: Iterable[int], seen: dict[int, psutil.Process], started: float, known: set[int]
) -> dict[int, psutil.Process]:
    """Every live process of job `job`: its live `workers`, their descendants, and orphans it left.

    `seen`: what earlier calls found (kept up to date here); `started`: the job's start (wall time);
    `known`: children of the supervisor that belong to others (workers, stores).
    """
    found: dict[int, psutil.Process] = {}
    for pid in workers:
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
            tag = c.environ().get(JOB)
            if tag == job or c.pid in seen:
                found[c.pid] = c
            elif tag is None and c.ppid() == me and c.create_time() >= started - 1:
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
    seen.update(found)
    return found
