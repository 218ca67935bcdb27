"""Profiling a call already running: `handle.profile(steps)` asks its ranks, waits for their traces, builds the
`Profile`.

The request is a file of the run directory (`profile.request`: its number and
steps, launch/files/profile_windows.py), which each rank's watch reads about
once a second; every rank opens its window at the same step, a few seconds of steps
past the furthest one's (as the watch's step files say; launch/rank/profiler.py)
and write numbered traces, which `build` reads as it reads `profile=N`'s. Works
for any call whose ranks run on this machine and are watched: a background, a
detached or a session call, from any process of the user. No IPython here.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import AirMagicError, ConfigurationError
from ..launch.files import profile_windows, step_times
from ..launch.files.rundir import RunDir
from . import check_profile
from .listener import build
from .profile import Profile

#: Seconds between two looks for the ranks' windows.
POLL = 0.2
#: Seconds of steps between the furthest rank's last step and the step every rank's window starts at.
LEAD = 3.0


def check(steps: object, watched: bool) -> None:
    """`handle.profile(steps)` of a call: steps a whole number, 1 or more, of a watched call."""
    if not watched:
        raise ConfigurationError(
            "this call runs with watch=False, and profiling counts the watch's steps; start it with the watch on."
        )
    check_profile(steps, True)


def profile_running(
    run_dir: Path, world_size: int, steps: int, timeout: float | None, running: Callable[[], bool]
) -> Profile:
    """Profile the next `steps` steps of every rank of the running call in `run_dir` (see the module; `check`
    first)."""
    return collect(run_dir, world_size, request(run_dir, world_size, steps), steps, timeout, running)


def request(run_dir: Path, world_size: int, steps: int) -> int:
    """Ask the call's ranks to profile `steps` steps, the same on every rank; the request's number."""
    run = RunDir(run_dir)
    last = profile_windows.read_request(run.profile_request)
    number = 1 if last is None else last[0] + 1
    profile_windows.write_request(run.profile_request, number, steps, start_step(run, world_size))
    return number


def start_step(run: RunDir, world_size: int, wait: float = LEAD) -> int:
    """The step every rank can still start at: past the furthest rank's step by LEAD seconds of steps (its watch's
    file is up to a second old, and it reads the request up to a second later), at least 2 steps. Waits up to `wait`
    seconds for every rank's first steps, whose length it needs."""
    deadline = time.monotonic() + wait
    while True:
        states = [step_times.read(run.steps(rank)) for rank in range(world_size)]
        known = [s for s in states if s is not None]
        totals = [step.total for s in known for step in s.recent]
        if (len(known) == world_size and all(s.recent for s in known)) or time.monotonic() > deadline:
            break
        time.sleep(POLL)
    step = statistics.median(totals) if totals else LEAD
    return max((s.count for s in known), default=0) + max(2, math.ceil(LEAD / max(step, 1e-6)))


def collect(
    run_dir: Path, world_size: int, number: int, steps: int, timeout: float | None, running: Callable[[], bool]
) -> Profile:
    """Wait for every rank's answer to request `number` (or the call's end, or `timeout`), and build its Profile."""
    run = RunDir(run_dir)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not all(run.profile_window(rank, number).exists() for rank in range(world_size)):
        if not running():
            break
        if deadline is not None and time.monotonic() > deadline:
            raise AirMagicError(
                f"the ranks did not profile {steps} step(s) within {timeout:g} s: a step is the watch's (a DataLoader "
                "batch, or an air_magic.step() call). Pass a longer timeout=, or fewer steps."
            )
        time.sleep(POLL)
    profile = build(run, world_size, number)
    if profile is None:
        raise AirMagicError(
            f"no rank profiled a step before the call ended (request {number} in {run.profile_request}); profile a "
            "call with more steps left, or pass profile= when you start it."
        )
    return profile
