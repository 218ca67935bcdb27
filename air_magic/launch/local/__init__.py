"""The local launcher: ranks on this machine, started by one supervisor process per kernel.

launcher.py    the notebook's side: LocalLauncher, the supervisor client, each job's handle
supervisor.py  the supervisor process: the job table and its loop
preload.py     its import cache (warm start), staleness checks and warm-ups
pool.py        hot ranks kept between calls
spawn.py       forking and spawning workers and rendezvous stores
jobs.py        a job's workers as the supervisor tracks them
trees.py       finding every process of a job

Only launcher.py is imported in the notebook; the rest runs in the supervisor.
"""

from __future__ import annotations

from .launcher import (
    SUPERVISOR_MODULE,
    LocalJob,
    LocalLauncher,
    LogTail,
    SupervisorClient,
)

__all__ = [
    "SUPERVISOR_MODULE",
    "LocalJob",
    "LocalLauncher",
    "LogTail",
    "SupervisorClient",
]
