"""Inside a profiled rank: torch.profiler over N of the watch's steps, and nothing outside them.

A call made with `profile=N` (`%%distributed --profile N`) arms a `Window` in
each rank's step recorder (steps.py). torch.profiler starts at the start of
the rank's step `SKIP` (step 0 pays for the DataLoader's start and DDP's
bucket rebuild), which is its warm-up: the profiler's own start delays each
rank by a different time, which the next collective would show as skew. The
N counted steps follow it, and the profiler stops once they have ended, or
when the call ends first (a step the call's end cut short is not counted).
It records CPU activity (and CUDA's when the rank has a GPU) only in between.
Outside the window the recorder's one check is an attribute read. In the window each step is a
`air_magic step K` range of the trace, and the watch's patches mark each
DataLoader `next()` (`air_magic: input`) and each blocking collective
(`air_magic: all_reduce #12`), which is what the notebook's analysis
(profiling/) splits the steps by.

When the window closes the rank writes its Chrome trace (`rank-N.trace.json`)
and what it covers (`rank-N.profile.json`, launch/files/profile_windows.py),
then goes on with its steps. A call already running is profiled the same way
when `handle.profile(steps)` asks (`asked`, read by the watch's own thread):
the window opens at the rank's next step. Not for the notebook's side (profiling/) nor for
the step times themselves (steps.py). Imports torch only when a window opens.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

from ..files import profile_windows as f
from ..files.rundir import RunDir

#: The step torch.profiler starts at, its warm-up (not counted): step 0 starts the DataLoader's workers and DDP's
#: first pass, not a usual step. The counted steps begin at SKIP + 1.
SKIP = 1
#: The prefix of every range the window adds to the trace.
MARK = "air_magic"
INPUT = f"{MARK}: input"


#: The last request of `handle.profile()` each call's ranks took, by run directory (a hot rank serves several calls).
_taken: dict[Path, int] = {}


def asked(run_dir: Path, rank: int) -> Window | None:
    """A window for a request of `handle.profile(steps)` not taken yet in this call (read from the watch's thread
    about once a second; one file's stat when there is none), else None."""
    run = RunDir(run_dir)
    request = f.read_request(run.profile_request)
    if request is None or request[0] <= _taken.get(run_dir, 0):
        return None
    number, steps, at = request
    _taken[run_dir] = number
    return Window(steps, rank, run.trace(rank, number), run.profile_window(rank, number), at)


def collective_mark(name: str, number: int) -> str:
    """The range a blocking collective is in the trace: 'air_magic: all_reduce #12'."""
    return f"{MARK}: {name} #{number}"


def step_mark(index: int) -> str:
    return f"{MARK} step {index}"


class Window:
    """N steps of one rank under torch.profiler: armed, started at step SKIP, counting from the next, then written."""

    def __init__(self, steps: int, rank: int, trace: Path, window: Path, at: int = SKIP) -> None:
        self.asked = steps
        self.at = max(SKIP, at)  # the warm-up step: the same on every rank, so their windows cover the same steps
        self.rank = rank
        self.trace = trace
        self.window = window
        self.open = False
        self.done = False
        self.first = -1
        self.step_times: list[tuple[float, float, float]] = []
        self._profiler: Any = None
        self._step: Any = None  # the record_function of the step in progress
        self._thread = 0

    # -- the recorder's calls (the rank's main thread) --------------------------------
    def boundary(self, index: int, ended: tuple[float, float, float] | None) -> bool:
        """Step `index` begins (the one before it ended, taking `ended`: total, input, collective seconds); True when
        the window opened or closed here (its own cost is then no step's time)."""
        if self.done:
            return False
        if self._profiler is None:
            if index < self.at:
                return False
            self._start()
            return True
        if not self.open:  # the warm-up step ended: the counted steps begin
            self.open = True
            self.first = index
            self._begin_step(index)
            return False
        self._end_step()
        if ended is not None:
            self.step_times.append(ended)
        if len(self.step_times) >= self.asked:
            self.close()
            return True
        self._begin_step(index)
        return False

    def mark(self, name: str) -> Any:
        """A record_function range `name` entered now (exit it with `leave`), or None outside the window."""
        if not self.open:
            return None
        from torch.autograd.profiler import record_function

        rf = record_function(name)
        rf.__enter__()
        return rf

    @staticmethod
    def leave(rf: Any) -> None:
        if rf is not None:
            rf.__exit__(None, None, None)

    def close(self) -> None:
        """Stop profiling and write the trace and what it covers (at the window's end, or the call's)."""
        if self.done:
            return
        self.done = True
        if not self.open:
            if self._profiler is not None:
                self._profiler.stop()
                self._profiler = None
            self._write("", "the call ended before a profiled step began")
            return
        self.open = False
        self._end_step()
        error = ""
        try:
            self._profiler.stop()
            self._profiler.export_chrome_trace(str(self.trace))
            os.chmod(self.trace, 0o600)
        except Exception as exc:  # noqa: BLE001 - a failed trace is said in the window's file, never the call's end
            error = f"torch.profiler failed: {type(exc).__name__}: {exc}"
        self._profiler = None
        self._write("" if error else self.trace.name, error)

    # -- inside ------------------------------------------------------------------------
    def _start(self) -> None:
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no "profiler_start" lines in the rank's output
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities)
            self._profiler.start()
        except Exception as exc:  # noqa: BLE001 - no profiler: the call goes on unprofiled, and says why
            self.done = True
            self._write("", f"torch.profiler could not start: {type(exc).__name__}: {exc}")
            return
        self._thread = threading.get_native_id()

    def _begin_step(self, index: int) -> None:
        self._step = self.mark(step_mark(index))

    def _end_step(self) -> None:
        step, self._step = self._step, None
        self.leave(step)

    def _write(self, trace: str, error: str) -> None:
        window = f.Window(
            rank=self.rank,
            asked=self.asked,
            steps=len(self.step_times),
            first=self.first,
            thread=self._thread,
            host=socket.gethostname(),
            trace=trace,
            error=error,
            step_times=tuple(self.step_times),
        )
        try:
            f.write(self.window, window)
        except OSError:
            pass  # a full disk: the notebook says the rank left no profile
