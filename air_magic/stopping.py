"""Stop after this step: the flag a Stop asks for, and `should_stop()`, which every rank reads.

A Stop (the panel's button, `%distributed_stop`, `request_stop(run_dir)`)
leaves a file in the call's run directory (`RunDir.stop_flag`); nothing is
signalled and nothing is killed. A rank reads it with `should_stop()`, which
looks at the file at most every CHECK_EVERY seconds and keeps the answer, so
a loop may call it every step for free. Ranks on another machine have their
own directory: the runner sees the flag and the launcher carries it there
(a Ray rank's actor writes it into its scratch directory).

Ranks see the file at slightly different moments, so where a process group
is initialized `should_stop()` is agreed on: an all-reduce (MAX) of each
rank's flag on the default group, so every rank answers the same at the same
call and a loop that checks it once per step ends at the same step
everywhere. That makes it a collective: call it on every rank, at the same
point of the loop.

Not for: ending a call at once (that is Cancel, launch/stopper.py), finding
the call a Stop is for (calls/table.py), or anything the notebook's display
does with the request (display/widgets.py).
This module imports neither torch nor IPython; it reads torch.distributed
only when the rank's code has imported it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from . import envvars
from .launch.files.rundir import RunDir

#: A rank looks at the flag's file at most this often, in seconds; between two looks it answers from memory.
CHECK_EVERY = 0.05


# -- the notebook's side --------------------------------------------------------------
def request_stop(run_dir: str | os.PathLike[str]) -> bool:
    """Ask the call whose run directory is `run_dir` to stop after its current step; False if it was asked before.

    Quick and thread-safe (one file created): a button's click handler may call it. The ranks see it through
    `should_stop()`; a call whose code never asks goes on to its end.
    """
    return RunDir(Path(run_dir)).request_stop()


def stop_requested(run_dir: str | os.PathLike[str]) -> bool:
    """A Stop was asked for the call whose run directory is `run_dir`."""
    return RunDir(Path(run_dir)).stop_flag.exists()


# -- a rank's side ----------------------------------------------------------------------
class _Flag:
    """This rank's view of the flag: which call it belongs to, when it was last looked at, what was seen."""

    run_dir: str | None = None
    looked_at = 0.0
    seen = False


_flag = _Flag()


def _seen_here() -> bool:
    run_dir = os.environ.get(envvars.INTERNAL_RUN_DIR)
    if run_dir != _flag.run_dir:  # a new call of a hot rank or a session: its own flag
        _flag.run_dir, _flag.looked_at, _flag.seen = run_dir, 0.0, False
    if _flag.seen or run_dir is None:
        return _flag.seen
    now = time.monotonic()
    if now - _flag.looked_at >= CHECK_EVERY:
        _flag.looked_at = now
        _flag.seen = os.path.exists(os.path.join(run_dir, RunDir.STOP_FLAG))
    return _flag.seen


def _agreed(local: bool) -> bool:
    """Every rank of the default process group answers True if any rank saw the flag (MAX all-reduce)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    import torch

    backend = str(dist.get_backend()).lower()
    on_gpu = backend == "nccl" or (backend.startswith("cuda:") and "cpu:" not in backend)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def should_stop() -> bool:
    """True once a Stop was asked for this call (the panel's Stop, `%distributed_stop`, `handle.stop()`).

    Check it once per step and leave the loop when it says so: the call returns normally. With a process
    group initialized it is a collective (call it on every rank at the same point) and every rank gets the
    same answer at the same step. Outside a rank (in the notebook) it is always False.
    """
    agreed = _agreed(_seen_here())
    if agreed:
        _flag.seen = True  # stays True for the rest of the call, on every rank alike
    return agreed
