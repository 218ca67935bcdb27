"""Watching a call with real ranks (2 CPU ranks, gloo), run from the test process: stragglers and hangs named."""

from __future__ import annotations

import inspect
import statistics
from typing import Any

import cloudpickle
import pytest

from air_magic import RankHungError, distributed
from air_magic.job import JobResult
from air_magic.launch.files import step_times
from air_magic.launch.files.rundir import RunDir
from air_magic.owner import owner
from air_magic.watching import listener

pytestmark = pytest.mark.slow


def _run(func: Any, *args: Any, **settings: Any) -> JobResult:
    """`func` on 2 CPU ranks through the runner and its default listeners (the watch among them), no MLflow."""
    module = inspect.getmodule(func)
    if module is not None:
        cloudpickle.register_pickle_by_value(module)  # the ranks need not import this test module
    settings = {"num_accelerators": 2, "accelerator_type": "CPU", "mlflow": False, "timeout": 600, **settings}
    spec = distributed(**settings)(func).settings.spec(func, args, {}, func.__name__)
    return owner().submit(spec)


def train(steps: int, slow_rank: int | None, slow: float) -> tuple[float | None, list[float]]:
    """A DDP-like loop: a DataLoader's batch, a little compute, an all_reduce; `slow_rank`'s input is `slow` s late.
    Returns when this rank reached step 150 (time.time()), if it did, and the seconds each of its sleeps really took
    (time.perf_counter(), measured by the rank)."""
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    slept: list[float] = []

    class Numbers(Dataset):
        def __len__(self) -> int:
            return steps

        def __getitem__(self, i: int) -> torch.Tensor:
            if rank == slow_rank:
                began = time.perf_counter()
                time.sleep(slow)
                slept.append(time.perf_counter() - began)
            return torch.full((64,), float(i))

    total, at_150 = torch.zeros(64), None
    for i, batch in enumerate(DataLoader(Numbers(), batch_size=None)):
        total += batch.sin()
        dist.all_reduce(total)
        if i == 150:
            at_150 = time.time()
    dist.destroy_process_group()
    return at_150, slept


def stuck_before_all_reduce(sleep: float, mark: str) -> int:
    """Rank 1 sleeps before its 6th all_reduce (only in the first attempt) while rank 0 waits in it; it writes to
    `mark` when it began to sleep (time.time())."""
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    for i in range(10):
        if rank == 1 and i == 5 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            with open(mark, "w") as out:
                out.write(repr(time.time()))
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


def marked_steps(steps: int, batches: int) -> int:
    """A loop that marks its steps with air_magic.step() (once before the first, once after each), taking `batches`
    batches from a DataLoader and doing one all_reduce a step."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import air_magic

    dist.init_process_group("gloo")
    t = torch.ones(4)
    air_magic.step()
    for _ in range(steps):
        for batch in DataLoader(range(batches), batch_size=None):
            t += batch
        dist.all_reduce(t)
        air_magic.step()
    dist.destroy_process_group()
    return steps


def late_to_all_reduce(steps: int, sleep: float) -> list[float]:
    """Rank 0 sleeps `sleep` s before each step's all_reduce, rank 1 goes straight to it; steps marked with
    air_magic.step(). Returns the seconds each of the rank's sleeps really took (time.perf_counter())."""
    import time

    import torch
    import torch.distributed as dist

    import air_magic

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.barrier()  # both ranks begin their first step together
    air_magic.step()
    slept: list[float] = []
    for _ in range(steps):
        if rank == 0:
            began = time.perf_counter()
            time.sleep(sleep)
            slept.append(time.perf_counter() - began)
        dist.all_reduce(t)
        air_magic.step()
    dist.destroy_process_group()
    return slept


def test_a_rank_slow_in_its_input_is_named_before_step_150(here_runs):
    """Rank 1's DataLoader 0.12 s late a step: named a straggler with cause input before rank 1's step 150 of 300,
    rank 0 never, its lag what rank 1 really slept a step; the step file counts every step, with rank 1's sleeps as
    its input wait."""
    result = _run(train, 300, 1, 0.12).raise_for_status()
    assert [(a.kind, a.rank, a.cause) for a in result.alerts] == [("straggler", 1, "input")], result.alerts
    alert = result.alerts[0]
    at_150, slept = result.values[1]
    assert alert.time < at_150, "named after step 150"
    assert "rank 1 is a straggler" in alert.message, alert.message
    # The lag is rank 1's input wait less rank 0's: what rank 1 slept a step, as rank 1 itself measured it.
    assert len(slept) == 300
    assert abs(alert.seconds - statistics.median(slept)) < 0.25 * statistics.median(slept), (alert, slept)
    steps = step_times.read(RunDir(result.run_dir).steps(1))
    others = step_times.read(RunDir(result.run_dir).steps(0))
    assert steps is not None and steps.count == 300 and steps.calls == 300
    assert others is not None and others.count == 300 and steps.collective is None
    # Every sleep of rank 1 is counted as input wait, and only rank 1 waited for its input.
    assert sum(slept) - 0.001 <= steps.input_total < 1.25 * sum(slept), (steps.input_total, sum(slept))
    assert others.input_total < 0.25 * sum(slept), others.input_total


def test_a_balanced_run_raises_no_alert_and_watch_false_keeps_no_file(here_runs):
    """The same loop balanced raises no alert; with watch=False the ranks keep no step file."""
    for _ in range(2):
        result = _run(train, 300, None, 0.0).raise_for_status()
        assert result.alerts == []
        assert step_times.read(RunDir(result.run_dir).steps(0)) is not None
    result = _run(train, 50, None, 0.0, watch=False).raise_for_status()
    assert result.alerts == [] and not RunDir(result.run_dir).steps(0).exists()


def test_a_rank_that_never_reaches_its_all_reduce_is_named_hung(here_runs, monkeypatch, tmp_path):
    """Rank 1 sleeps before its all_reduce while rank 0 waits in it: named hung with where it is and for as long as it
    had slept when named (AIR_MAGIC_HANG_AFTER=3 s here), and on_hang="stop" ends the call with RankHungError."""
    monkeypatch.setenv("AIR_MAGIC_HANG_AFTER", "3")
    mark = tmp_path / "asleep"
    result = _run(stuck_before_all_reduce, 120, str(mark), on_hang="stop")
    assert isinstance(result.error, RankHungError), result.error
    assert [(a.kind, a.rank) for a in result.alerts] == [("hang", 1)]
    alert = result.alerts[0]
    assert "rank 1 hangs" in alert.message and "rank 0 waits in all_reduce #6" in alert.message, alert.message
    assert "stuck_before_all_reduce" in alert.message, alert.message
    # The hang's seconds are rank 1's sleep up to the alert, as rank 1 itself marked its start: never more, and less
    # by at most the time the watch takes to see the rank's last file (one reading, at most a few).
    asleep = alert.time - float(mark.read_text())
    assert asleep - (listener.PERIOD + 2) <= alert.seconds <= asleep + 0.5, (alert.seconds, asleep)


def test_under_ddp_a_rank_that_never_reaches_its_forward_is_named_hung(here_runs, monkeypatch):
    """Under DDP (no collective of torch.distributed's Python functions) the hung rank is named too."""
    monkeypatch.setenv("AIR_MAGIC_HANG_AFTER", "3")
    result = _run(stuck_before_ddp_forward, 120, on_hang="stop")
    assert isinstance(result.error, RankHungError), result.error
    assert [(a.kind, a.rank) for a in result.alerts] == [("hang", 1)]
    assert "DDP's gradient all-reduce #6" in result.alerts[0].message


def test_on_hang_restart_starts_every_rank_again(here_runs, monkeypatch, tmp_path):
    """on_hang="restart" with max_restarts=1: the hung attempt is stopped and the next one finishes."""
    monkeypatch.setenv("AIR_MAGIC_HANG_AFTER", "3")
    result = _run(stuck_before_all_reduce, 120, str(tmp_path / "asleep"), on_hang="restart", max_restarts=1)
    result.raise_for_status()
    assert result.attempts == 2 and result.values == [0, 1]
    assert [(a.kind, a.rank) for a in result.alerts] == [("hang", 1)]


def test_air_magic_step_marks_the_steps_a_rank_counts(here_runs):
    """In real ranks each air_magic.step() ends a step: the rank's step file counts those steps, not the batches its
    DataLoaders gave, and one collective a step."""
    result = _run(marked_steps, 12, 3).raise_for_status()
    for rank in (0, 1):
        steps = step_times.read(RunDir(result.run_dir).steps(rank))
        assert steps is not None and steps.rank == rank, steps
        assert steps.count == 12 and steps.calls == 12, steps
        assert [s.index for s in steps.recent] == list(range(12)), steps.recent


def test_a_rank_waiting_for_a_late_peer_shows_it_as_collective_wait(here_runs):
    """Rank 0 sleeps before each all_reduce: rank 1's collective wait is what rank 0 slept, and rank 0's own time
    (compute) holds its sleeps while it barely waits in collectives."""
    result = _run(late_to_all_reduce, 20, 0.1).raise_for_status()
    slept = sum(result.values[0])
    assert len(result.values[0]) == 20 and result.values[1] == []
    late = step_times.read(RunDir(result.run_dir).steps(0))
    waiting = step_times.read(RunDir(result.run_dir).steps(1))
    assert late is not None and waiting is not None and late.count == waiting.count == 20, (late, waiting)
    assert abs(waiting.collective_total - slept) < 0.25 * slept, (waiting.collective_total, slept)
    late_compute = late.step_total - late.input_total - late.collective_total
    waiting_compute = waiting.step_total - waiting.input_total - waiting.collective_total
    assert late_compute >= slept - 0.001 and late_compute > waiting_compute, (late, waiting, slept)
    assert late.collective_total < 0.25 * slept, (late.collective_total, slept)
    assert [s.collective > s.compute for s in waiting.recent] == [True] * 20, waiting.recent
