"""Watching a call with real ranks (2 CPU ranks, gloo), run from the test process: stragglers and hangs named."""

from __future__ import annotations

import inspect
from typing import Any

import cloudpickle
import pytest

from air_magic import RankHungError, distributed
from air_magic.job import JobResult
from air_magic.launch.files import step_times
from air_magic.launch.files.rundir import RunDir
from air_magic.owner import owner
from air_magic.watching import detector, listener

pytestmark = pytest.mark.slow


def _run(func: Any, *args: Any, **settings: Any) -> JobResult:
    """`func` on 2 CPU ranks through the runner and its default listeners (the watch among them), no MLflow."""
    module = inspect.getmodule(func)
    if module is not None:
        cloudpickle.register_pickle_by_value(module)  # the ranks need not import this test module
    settings = {"num_accelerators": 2, "accelerator_type": "CPU", "mlflow": False, "timeout": 600, **settings}
    spec = distributed(**settings)(func).settings.spec(func, args, {}, func.__name__)
    return owner().submit(spec)


def train(steps: int, slow_rank: int | None, slow: float) -> float | None:
    """A DDP-like loop: a DataLoader's batch, a little compute, an all_reduce; `slow_rank`'s input is `slow` s late.
    Returns when this rank reached step 150 (time.time()), if it did."""
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class Numbers(Dataset):
        def __len__(self) -> int:
            return steps

        def __getitem__(self, i: int) -> torch.Tensor:
            if rank == slow_rank:
                time.sleep(slow)
            return torch.full((64,), float(i))

    total, at_150 = torch.zeros(64), None
    for i, batch in enumerate(DataLoader(Numbers(), batch_size=None)):
        total += batch.sin()
        dist.all_reduce(total)
        if i == 150:
            at_150 = time.time()
    dist.destroy_process_group()
    return at_150


def stuck_before_all_reduce(sleep: float) -> int:
    """Rank 1 sleeps before its 6th all_reduce (only in the first attempt) while rank 0 waits in it."""
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    for i in range(10):
        if rank == 1 and i == 5 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            time.sleep(sleep)
        dist.all_reduce(t)
    dist.destroy_process_group()
    return rank


def stuck_before_ddp_forward(sleep: float) -> int:
    """Rank 1 sleeps before its 6th DDP forward while rank 0 waits in backward() (DDP's all-reduce, in C++)."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(nn.Linear(8, 8))
    for i in range(10):
        if rank == 1 and i == 5:
            time.sleep(sleep)
        model(torch.ones(2, 8)).sum().backward()
    dist.destroy_process_group()
    return rank


def test_a_rank_slow_in_its_input_is_named_before_step_150(here_runs):
    """Rank 1's DataLoader 0.12 s late a step: named a straggler with cause input before rank 1's step 150 of 300,
    rank 0 never; the step file counts every step, with rank 1's input wait."""
    result = _run(train, 300, 1, 0.12).raise_for_status()
    assert [(a.kind, a.rank, a.cause) for a in result.alerts] == [("straggler", 1, "input")], result.alerts
    alert = result.alerts[0]
    assert alert.time < result.values[1], "named after step 150"
    # A straggler is named only past the rule's least lag (a threshold the product keeps, not a speed: load only adds)
    assert alert.seconds > detector.LAG_SECONDS and "rank 1 is a straggler" in alert.message
    steps = step_times.read(RunDir(result.run_dir).steps(1))
    assert steps is not None and steps.count == 300 and steps.calls == 300
    assert steps.input_total > 300 * 0.1 and steps.collective is None


def test_a_balanced_run_raises_no_alert_and_watch_false_keeps_no_file(here_runs):
    """The same loop balanced raises no alert; with watch=False the ranks keep no step file."""
    for _ in range(2):
        result = _run(train, 300, None, 0.0).raise_for_status()
        assert result.alerts == []
        assert step_times.read(RunDir(result.run_dir).steps(0)) is not None
    result = _run(train, 50, None, 0.0, watch=False).raise_for_status()
    assert result.alerts == [] and not RunDir(result.run_dir).steps(0).exists()


def test_a_rank_that_never_reaches_its_all_reduce_is_named_hung(here_runs, monkeypatch):
    """Rank 1 sleeps before its all_reduce while rank 0 waits in it: named hung with where it is, past the threshold
    (AIR_MAGIC_HANG_AFTER=3 s here), and on_hang="stop" ends the call with RankHungError."""
    monkeypatch.setenv("AIR_MAGIC_HANG_AFTER", "3")
    result = _run(stuck_before_all_reduce, 120, on_hang="stop")
    assert isinstance(result.error, RankHungError), result.error
    assert [(a.kind, a.rank) for a in result.alerts] == [("hang", 1)]
    message = result.alerts[0].message
    assert "rank 1 hangs" in message and "rank 0 waits in all_reduce #6" in message, message
    # A hang is named only once the rank has made no progress for the threshold (a rule, not a speed: load only adds)
    assert "stuck_before_all_reduce" in message and result.alerts[0].seconds >= listener.hang_after()


def test_under_ddp_a_rank_that_never_reaches_its_forward_is_named_hung(here_runs, monkeypatch):
    """Under DDP (no collective of torch.distributed's Python functions) the hung rank is named too."""
    monkeypatch.setenv("AIR_MAGIC_HANG_AFTER", "3")
    result = _run(stuck_before_ddp_forward, 120, on_hang="stop")
    assert isinstance(result.error, RankHungError), result.error
    assert [(a.kind, a.rank) for a in result.alerts] == [("hang", 1)]
    assert "DDP's gradient all-reduce #6" in result.alerts[0].message


def test_on_hang_restart_starts_every_rank_again(here_runs, monkeypatch):
    """on_hang="restart" with max_restarts=1: the hung attempt is stopped and the next one finishes."""
    monkeypatch.setenv("AIR_MAGIC_HANG_AFTER", "3")
    result = _run(stuck_before_all_reduce, 120, on_hang="restart", max_restarts=1).raise_for_status()
    assert result.attempts == 2 and result.values == [0, 1]
    assert [(a.kind, a.rank) for a in result.alerts] == [("hang", 1)]
