"""Inside a watched rank: how long DDP's gradient all-reduce made this rank wait for its peers, step by step.

DDP reduces gradients in C++ inside `backward()`, so the watch's patches of torch.distributed's Python collectives
(steps.py) never see it, and a rank that waits there for a slower peer looks as busy computing as the slow one.
With `AIR_MAGIC_WATCH_DDP=1` in the calling process's environment (off by default: the profile analysis,
profiling/, of a profile asked of the call mid-run reads the hook's wait as compute), at a DDP module's first
training forward, unless the user's code registered a communication hook of its own, this module registers one
(`ddp.register_comm_hook`) that does what DDP does by default (the bucket divided by the group's size, then
all-reduced: the mean of the ranks' gradients) and notes, for each bucket, when this rank launched it and when the
reduction completed. The wait of one backward is the time from its last bucket's launch (this rank's gradients are
all ready) to the last completion: a rank whose peers are slower waits that long; the slowest rank hardly waits.
`take()` hands the wait of the backwards since the last step boundary to the recorder, which counts it as the
step's collective wait, so a rank slow in its own compute is the one whose compute is longer.

What it cannot see: a communication hook the user registered (then nothing is measured: DDP allows one hook),
FSDP (its collectives run in C++ too; its wait counts as compute), and on NCCL only the wait as the completion
callback sees it. This module imports torch only from a rank's DDP forward, where torch is loaded.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ...envvars import PROFILE, WATCH_DDP

_clock = time.perf_counter
_lock = threading.Lock()
#: (launched, completed) times of the buckets reduced since the last `take`.
_launched: list[float] = []
_completed: list[float] = []


def watch(ddp: Any) -> None:
    """Measure `ddp`'s all-reduce wait from now on, unless it has a communication hook (its user's), is watched
    already, or the call is profiled (torch.profiler's trace then shows DDP's own all-reduce, profiling/)."""
    if getattr(ddp, "_air_magic_waits", False) or getattr(ddp, "_air_magic_user_hook", False):
        return
    if os.environ.get(PROFILE) or os.environ.get(WATCH_DDP, "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    ddp._air_magic_waits = True
    try:
        ddp.register_comm_hook(getattr(ddp, "process_group", None), _timed_allreduce)
    except RuntimeError:  # a hook registered by other means (a builtin one): DDP keeps it, nothing is measured
        pass


def user_hook(register: Any) -> Any:
    """`DistributedDataParallel.register_comm_hook` (or the builtin one), noting that the user chose a hook."""

    def registered(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args and args[-1] is not _timed_allreduce:
            self._air_magic_user_hook = True
        return register(self, *args, **kwargs)

    return registered


def _timed_allreduce(process_group: Any, bucket: Any) -> Any:
    """DDP's default reduction of one bucket (the mean over the group: divided by its size, then summed), with the
    times of its launch and completion noted. The all-reduce is torch's own, not the watch's patched one: it is
    not a collective of the user's code (the DDP forward counts as it, steps.py)."""
    import torch.distributed as dist

    group: Any = process_group if process_group is not None else dist.group.WORLD
    gradients = bucket.buffer()
    gradients.div_(group.size())
    all_reduce = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)
    launched = _clock()
    work = all_reduce(gradients, group=group, async_op=True)

    def completed(done: Any) -> Any:
        with _lock:
            _launched.append(launched)
            _completed.append(_clock())
        return done.value()[0]

    return work.get_future().then(completed)


# DDP checks a hook's annotations against torch's own types (a bucket must be `dist.GradBucket`); this module
# imports no torch at import time, so the hook carries none.
_timed_allreduce.__annotations__ = {}


def take() -> float:
    """The all-reduce wait, in seconds, of the backwards since the last call (0 when there were none)."""
    with _lock:
        if not _launched:
            return 0.0
        wait = max(0.0, max(_completed) - max(_launched))
        _launched.clear()
        _completed.clear()
    return wait
