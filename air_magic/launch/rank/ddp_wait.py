"""Inside a watched rank: how long DDP's gradient all-reduce made this rank wait for its peers, step by step.

DDP reduces gradients in C++ inside `backward()`, so the watch's patches of torch.distributed's Python collectives
(steps.py) never see it, and a rank that waits there for a slower peer looks as busy computing as the slow one.
DDP launches each bucket's all-reduce as soon as its gradients are ready, and at the end of the backward pass waits
for them all (its reducer's final callback) before `backward()` returns. This module times that wait with two
final callbacks of the autograd engine around DDP's: one queued when the backward pass reaches the DDP module's
output (steps.py calls `watch` with the output of each DDP forward in training), so it runs first, once every
gradient of the pass is computed (this rank's buckets are all launched); it queues the other, which runs after
DDP's. The time between them is the step's wait: a rank whose peers are slower waits that long; the slowest rank
hardly waits (the reduced gradients' copy back into `.grad`, the same on every rank, is in it too). `take()` hands
the wait of the backwards since the last step boundary to the recorder, which counts it as the step's collective
wait, so a rank slow in its own compute is the one whose compute is longer.

Nothing of DDP's changes: no communication hook is registered (a hook of the user's is theirs, and its futures'
wait is measured the same way), its reduction stays its own (C++, the division by the world size fused into the
gradients' copy), and the cost is a look at the forward's output and three Python calls per backward, not per
bucket (bench/ddp_wait.py). `AIR_MAGIC_WATCH_DDP=0` in the calling process's environment turns it off.

What it cannot see: FSDP (its collectives run in C++ too; its wait counts as compute), DDP whose output holds no
tensor the backward pass goes through (a container it cannot open), DDP under compiled autograd (it reduces in
Python, with no final wait), and on GPUs (NCCL) the wait on the GPU: DDP's final wait there only orders the GPU's
streams, so the CPU measures little; the GPU's wait shows where the rank's code waits for the GPU. This module
imports torch only from a rank's DDP forward, where torch is loaded.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ...envvars import WATCH_DDP

_clock = time.perf_counter
_lock = threading.Lock()
#: The all-reduce wait, in seconds, of the backwards since the last `take`.
_waited = 0.0
#: A DDP forward in training ran and its backward has not reached the DDP output yet.
_armed = False
#: When the backward's gradients were all computed (the first final callback ran).
_computed_at = 0.0
#: Graph nodes a DDP output's tensors are looked for in, at most (a large dict of outputs is not walked whole).
NODES = 8


def enabled() -> bool:
    """Whether the calling process's environment leaves the measure on (`AIR_MAGIC_WATCH_DDP`, default on)."""
    return os.environ.get(WATCH_DDP, "1").strip().lower() not in ("0", "false", "no", "off")


def watch(ddp: Any, output: Any) -> None:
    """The output of a forward of `ddp` in training: the backward pass that goes through it measures DDP's wait
    (not under compiled autograd, where DDP reduces in Python, with no final wait of its reducer)."""
    global _armed
    if getattr(ddp, "_use_python_reducer", False) or not enabled():
        return
    nodes = _grad_fns(output)
    if nodes:
        _armed = True
        for node in nodes:
            register = getattr(node, "register_prehook", None)  # torch 2.0 on
            if register is not None:
                register(_reached)


def _grad_fns(output: Any) -> list[Any]:
    """The distinct graph nodes of the tensors in `output` (a tensor, or lists, tuples and dicts of them)."""
    import torch

    found: dict[int, Any] = {}
    todo = [output]
    while todo and len(found) < NODES:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            if item.grad_fn is not None:
                found.setdefault(id(item.grad_fn), item.grad_fn)
        elif isinstance(item, (list, tuple)):
            todo.extend(item[:NODES])
        elif isinstance(item, dict):
            todo.extend(list(item.values())[:NODES])
    return list(found.values())


def _reached(grad_outputs: Any) -> None:
    """The backward pass reached the DDP output: queue the first final callback (before DDP's own, which DDP queues
    once its last bucket is ready)."""
    global _armed
    if _armed:
        _armed = False
        _queue(_computed)


def _computed() -> None:
    global _computed_at
    _computed_at = _clock()
    _queue(_reduced)  # runs after DDP's final callback, queued meanwhile


def _reduced() -> None:
    global _waited
    with _lock:
        _waited += max(0.0, _clock() - _computed_at)


def _queue(callback: Any) -> None:
    from torch.autograd import Variable

    try:
        Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # not inside a backward pass after all: nothing is measured
        pass


def take() -> float:
    """The all-reduce wait, in seconds, of the backwards since the last call (0 when there were none)."""
    global _waited
    with _lock:
        wait, _waited = _waited, 0.0
    return wait
