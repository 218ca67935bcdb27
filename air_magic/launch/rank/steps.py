"""Inside a watched rank: how each step splits into waiting for input, waiting in collectives and computing.

With no change to the user's code. A step is the interval between two batches taken from a DataLoader (the
moment the loop asks for the next one), or between two `air_magic.step()` calls once the code makes one (then
DataLoaders only count input time). Patches made once per process, idle (one global read) when not watched:

- `torch.utils.data.dataloader._BaseDataLoaderIter.__next__`: the time each `next()` takes is the step's input
  wait, and its start ends the last step;
- the blocking collectives of `torch.distributed` (`all_reduce`, `barrier`, `broadcast`, `all_gather`, ... and
  `send`/`recv`): their time is the step's collective wait, and while one runs the rank is "in all_reduce #12
  since t". A collective called inside another (the object collectives call the tensor ones) counts once;
- DDP's forward, counted as the collective it leads to (a rank that never reaches its forward is behind); DDP's
  gradient all-reduce runs in C++ inside `backward()`, and its wait is measured by ddp_wait.py.

Not seen: a call with `async_op=True` returns at once and its `wait()` counts as compute; on NCCL a collective
returns when it is queued on the GPU, so the GPU's wait shows later, where the code waits for the GPU. The rank
says which collective it called last with nothing done since, which is what the hang rule reads.

With `profile=N` the recorder also holds a torch.profiler window over N steps (profiler.py); outside it, the
one more check per batch, step and collective is an attribute read.

The main thread only adds up `time.perf_counter()` differences; a daemon thread rewrites the rank's file
(launch/files/step_times.py) about once a second when something changed, so a hung rank's last state is on disk.
Hot ranks keep the patches and the thread; each call gets its own file (`start`, `stop`). This module imports no
IPython or MLflow, and torch only when `start` is called in a rank that has it.

Over 300 lines because the recorder and the patches that feed it share one state per rank, kept in one place; the
profiler's window is a module of its own (profiler.py).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..files import step_times as f
from . import ddp_wait
from .profiler import INPUT, Window, asked, collective_mark

#: Seconds between two writes of the rank's file (when something changed).
FLUSH = 1.0
# fmt: off
#: The blocking collectives of torch.distributed whose time is a wait for peers.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv",
)
# fmt: on

_clock = time.perf_counter


class Recorder:
    """One call's step times in one rank, added up by the rank's code and written by the flusher."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.count = 0
        self.step_start: float | None = None
        self.step_input = 0.0
        self.step_collective = 0.0
        self.input_total = 0.0
        self.collective_total = 0.0
        self.step_total = 0.0
        self.recent: deque[f.Step] = deque(maxlen=f.KEPT)
        self.progress = _clock()
        self.calls = 0
        self.depth = 0
        #: (name, number, since) of the collective the rank is in now / called last with nothing done since.
        self.current: tuple[str, int, float] | None = None
        self.after: tuple[str, int, float] | None = None
        #: air_magic.step() was called: DataLoaders no longer end steps.
        self.explicit = False
        self.changes = 0
        self.written = -1
        #: One pair of readings converts every time written: a state written twice reads the same both times.
        self.wall0, self.clock0 = time.time(), _clock()
        #: The profiled steps (profiler.py), while armed or open; None outside them. Only the main thread sets it;
        #: a window `handle.profile()` asked for waits in `asked` until the next step.
        self.window: Window | None = None
        self.asked: Window | None = None

    def wall(self, at: float) -> float:
        return self.wall0 + (at - self.clock0)  # the wall-clock time of `at` (this module's clock)

    def boundary(self, now: float) -> None:
        """A step ends (and the next begins) at `now`; DDP's all-reduce wait in it is its collective wait."""
        self.step_collective += ddp_wait.take()
        start = self.step_start
        ended = None
        if start is not None:
            total = now - start
            self.recent.append(f.Step(self.count, total, self.step_input, self.step_collective))
            self.count += 1
            self.input_total += self.step_input
            self.collective_total += self.step_collective
            self.step_total += total
            ended = (total, self.step_input, self.step_collective)
        self.step_start = now
        self.step_input = self.step_collective = 0.0
        self.progress = now
        self.after = None
        self.changes += 1
        if self.asked is not None and self.window is None:
            self.window, self.asked = self.asked, None
        window = self.window
        if window is not None and window.boundary(self.count, ended):  # it opened or closed: not the step's time
            self.step_start = self.progress = _clock()
            if window.done:
                self.window = None

    def snapshot(self) -> f.RankSteps:
        """What the file says now (read from the flusher's thread)."""

        def coll(c: tuple[str, int, float] | None) -> f.Collective | None:
            return None if c is None else f.Collective(c[0], c[1], self.wall(c[2]))

        return f.RankSteps(
            rank=self.rank,
            pid=os.getpid(),
            now=self.wall(_clock()),
            count=self.count,
            progress=self.wall(self.progress),
            calls=self.calls,
            input_total=self.input_total,
            collective_total=self.collective_total,
            step_total=self.step_total,
            collective=coll(self.current),
            after=coll(self.after),
            recent=tuple(self.recent),
        )

    def flush(self) -> None:
        changes = self.changes
        if changes == self.written:
            return
        self.written = changes
        try:
            f.write(self.path, self.snapshot())
        except OSError:
            pass  # a full disk: the next change tries again


_recorder: Recorder | None = None
_patched = False
_flusher: threading.Thread | None = None
_lock = threading.Lock()


def start(path: Path, rank: int) -> None:
    """Watch this call in this rank: its steps go to `path` (the run directory's `rank-N.steps.json`)."""
    global _recorder, _flusher
    _patch()
    recorder = Recorder(path, rank)
    recorder.flush()  # the file exists from the start: the notebook knows the rank is watched
    with _lock:
        _recorder = recorder
        if _flusher is None or not _flusher.is_alive():
            _flusher = threading.Thread(target=_flush_loop, name="air_magic-steps", daemon=True)
            _flusher.start()


def profile(steps: int, trace: Path, window: Path) -> None:
    """Profile `steps` of this call's steps with torch.profiler (profiler.py): the trace goes to `trace`, what it
    covers to `window`. Only in a watched rank (after `start`)."""
    recorder = _recorder
    if recorder is not None:
        recorder.window = Window(steps, recorder.rank, trace, window)


def stop() -> None:
    """The call is over: its last state goes to its file, and the rank records nothing until the next `start`.

    A profile window still open is closed and written with the steps it has."""
    global _recorder
    with _lock:
        recorder, _recorder = _recorder, None
    if recorder is not None:
        for window in (recorder.window, recorder.asked):
            if window is not None:
                window.close()
        recorder.window = recorder.asked = None
        recorder.changes += 1
        recorder.flush()


def step() -> None:
    """Mark the end of a training step (and the start of the next) for air_magic's watch of the call.

    Needed only when the loop takes no batch from a DataLoader; once called, steps are counted from these
    calls alone. Outside a watched rank it does nothing.
    """
    recorder = _recorder
    if recorder is not None:
        recorder.explicit = True
        recorder.boundary(_clock())


def _flush_loop() -> None:
    while True:
        time.sleep(FLUSH)
        recorder = _recorder
        if recorder is not None:
            if recorder.asked is None:
                recorder.asked = asked(recorder.path.parent, recorder.rank)  # handle.profile() (profiler.py)
            recorder.flush()


# -- the patches -------------------------------------------------------------------
def _patch() -> None:
    """Wrap DataLoader iterators' `__next__` and torch.distributed's collectives, once per process."""
    global _patched
    if _patched or "torch" not in sys.modules and not _importable("torch"):
        return
    _patched = True
    try:
        from torch.utils.data import dataloader
    except ImportError:
        return
    iterator = dataloader._BaseDataLoaderIter
    iterator.__next__ = _timed_next(iterator.__next__)  # type: ignore[method-assign,assignment]
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not dist.is_available():
        return
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:
        pass
    else:
        DDP.forward = _counted_forward(DDP.forward)  # type: ignore[method-assign]
    c10d = dist.distributed_c10d
    for name in COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "air_magic_watched", False):
            continue
        wrapped = _timed_collective(name, fn)
        for module in (dist, c10d):
            if getattr(module, name, None) is fn:
                setattr(module, name, wrapped)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _timed_next(next_: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(next_)
    def __next__(self: Any) -> Any:
        recorder = _recorder
        if recorder is None:
            return next_(self)
        began = _clock()
        if not recorder.explicit:
            recorder.boundary(began)
            began = recorder.step_start or began  # moved on by a profile window's opening or closing
        window = recorder.window
        mark = None if window is None else window.mark(INPUT)
        try:
            return next_(self)
        except StopIteration:
            if not recorder.explicit:
                recorder.step_start = None  # no batch: no step began
            raise
        finally:
            Window.leave(mark)
            ended = _clock()
            recorder.step_input += ended - began
            recorder.progress = ended
            recorder.changes += 1

    return __next__


#: How a DDP forward is named as the collective it leads to.
DDP_ALL_REDUCE = "DDP's gradient all-reduce"


def _counted_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Count each DDP forward as the collective its backward() will wait in (DDP's all-reduce, in C++), whose wait
    ddp_wait.py measures from the forward's output."""

    @functools.wraps(forward)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None or not self.training or not getattr(self, "require_backward_grad_sync", True):
            return forward(self, *args, **kwargs)
        now = _clock()
        recorder.calls += 1
        recorder.after = (DDP_ALL_REDUCE, recorder.calls, now)
        recorder.progress = now
        recorder.changes += 1
        output = forward(self, *args, **kwargs)
        ddp_wait.watch(self, output)
        return output

    return counted


def _timed_collective(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None or recorder.depth:
            return fn(*args, **kwargs)
        began = _clock()
        recorder.depth = 1
        recorder.calls += 1
        number = recorder.calls
        recorder.current = (name, number, began)
        recorder.progress = began
        recorder.changes += 1
        window = recorder.window
        mark = None if window is None else window.mark(collective_mark(name, number))
        try:
            return fn(*args, **kwargs)
        finally:
            Window.leave(mark)
            ended = _clock()
            recorder.depth = 0
            recorder.current = None
            recorder.after = (name, number, began)
            recorder.step_collective += ended - began
            recorder.progress = ended
            recorder.changes += 1

    collective.air_magic_watched = True  # type: ignore[attr-defined]
    return collective
