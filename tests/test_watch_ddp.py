"""The watch under DDP, with real ranks (2 CPU ranks, gloo), as it is by default: DDP's gradient all-reduce wait is
measured per rank, so a rank slow in its own compute is named, and a balanced run is not; a communication hook of the
user's runs as theirs, registered before training or after it began."""

from __future__ import annotations

import inspect
from typing import Any

import cloudpickle
import pytest

from air_magic import distributed, envvars
from air_magic.job import JobResult
from air_magic.launch.files import step_times
from air_magic.launch.files.rundir import RunDir
from air_magic.owner import owner

pytestmark = pytest.mark.slow

#: Rank 1's extra time in its own code per step, in seconds.
EXTRA = 0.15


def _run(func: Any, *args: Any) -> JobResult:
    """`func` on 2 CPU ranks with the default listeners (the watch among them), no MLflow."""
    module = inspect.getmodule(func)
    if module is not None:
        cloudpickle.register_pickle_by_value(module)  # the ranks need not import this test module
    settings = {"num_accelerators": 2, "accelerator_type": "CPU", "mlflow": False, "timeout": 600}
    return owner().submit(distributed(**settings)(func).settings.spec(func, args, {}, func.__name__))


def ddp_train(steps: int, slow_rank: int | None, extra: float, hook: bool = False) -> dict[str, float]:
    """A DDP loop over a DataLoader; `slow_rank` spends `extra` s more in its forward each step; with `hook`, the
    model reduces with a communication hook of the user's (torch's allreduce_hook). Returns when this rank reached
    step 150 (time.time()) and how long it spent in its own extra work in all."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(torch.randn(steps, 64)), batch_size=None)
    spent, at_150 = 0.0, 0.0
    for i, (batch,) in enumerate(data):
        loss = model(batch).pow(2).mean()
        if rank == slow_rank:
            began = time.perf_counter()
            time.sleep(extra)  # this rank's own work, before its gradients are ready
            spent += time.perf_counter() - began
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i == 150:
            at_150 = time.time()
    dist.destroy_process_group()
    return {"at_150": at_150, "spent": spent}


def test_under_ddp_a_rank_slow_in_its_compute_is_named_and_its_peer_waits_in_the_all_reduce(here_runs):
    """Rank 1 spends 0.15 s more per step before its backward: it is named a straggler with cause compute before its
    step 150 of 300, rank 0 never; rank 0's files count about rank 1's extra time as DDP all-reduce wait."""
    result = _run(ddp_train, 300, 1, EXTRA).raise_for_status()
    assert [(a.kind, a.rank, a.cause) for a in result.alerts] == [("straggler", 1, "compute")], result.alerts
    assert result.alerts[0].time < result.values[1]["at_150"], "named before step 150"
    fast = step_times.read(RunDir(result.run_dir).steps(0))
    slow = step_times.read(RunDir(result.run_dir).steps(1))
    assert fast is not None and slow is not None and fast.count == slow.count == 300
    spent = result.values[1]["spent"]
    # rank 0 waited in DDP's all-reduce for rank 1's extra work (most of it: rank 0's own part overlaps a little)
    assert 0.7 * spent < fast.collective_total < 1.3 * spent + 300 * 0.05, (fast.collective_total, spent)
    assert slow.collective_total < 0.3 * fast.collective_total, (slow.collective_total, fast.collective_total)


def test_a_balanced_ddp_run_raises_no_alert(here_runs):
    """The same DDP loop with both ranks alike raises no alert, and counts some all-reduce wait on each rank."""
    result = _run(ddp_train, 300, None, 0.0).raise_for_status()
    assert result.alerts == []
    for rank in (0, 1):
        steps = step_times.read(RunDir(result.run_dir).steps(rank))
        assert steps is not None and steps.count == 300 and steps.collective_total > 0


def user_hooks(steps: int) -> dict[str, Any]:
    """Three DDP models trained side by side: `early` gets a hook of the user's before training, `late` after its
    first step (DDP takes one hook: the watch registers none), `plain` none. Returns how many buckets each user hook
    reduced, and whether `late` can be copied and `plain` saved (DDP pickles its hooks and their state)."""
    import copy
    import io

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo")
    calls = {"early": 0, "late": 0}

    def counted(name: str) -> Any:
        def hook(state, bucket):  # no annotations: DDP checks them against its own types
            calls[name] += 1
            work = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)
            return work.get_future().then(lambda done: done.value()[0])

        return hook

    torch.manual_seed(0)
    early, late, plain = (DistributedDataParallel(torch.nn.Linear(8, 8)) for _ in range(3))
    early.register_comm_hook(None, counted("early"))
    for i, (batch,) in enumerate(DataLoader(TensorDataset(torch.randn(steps, 8)), batch_size=None)):
        for model in (early, late, plain):
            model(batch).sum().backward()
        if i == 0:
            late.register_comm_hook(None, counted("late"))
    copy.deepcopy(late)
    torch.save(plain, io.BytesIO())
    dist.destroy_process_group()
    return {**calls, "copied": True}


def test_the_users_own_comm_hook_runs_whether_registered_before_training_or_after_it_began(here_runs):
    """A hook the user registers before the first forward is DDP's hook; one registered after the first step (once
    the watch measures the model) runs from the next step on, with no error; a watched model can still be copied and
    saved."""
    result = _run(user_hooks, 20).raise_for_status()
    assert result.values == [{"early": 20, "late": 19, "copied": True}] * 2


def test_air_magic_watch_ddp_0_turns_the_measure_off(here_runs, monkeypatch):
    """With AIR_MAGIC_WATCH_DDP=0 in the caller's environment the ranks measure no DDP wait: no collective wait at all
    (the loop has no collective of its own), where the same balanced loop counts some on each rank by default."""
    monkeypatch.setenv(envvars.WATCH_DDP, "0")
    result = _run(ddp_train, 20, None, 0.0).raise_for_status()
    for rank in (0, 1):
        steps = step_times.read(RunDir(result.run_dir).steps(rank))
        assert steps is not None and steps.count == 20 and steps.collective_total == 0


def test_under_a_users_comm_hook_the_compute_straggler_is_named_too(here_runs):
    """With the user's own communication hook (torch's allreduce_hook) the wait for its futures is measured the same
    way: rank 1, 0.15 s slower in its own work a step, is named with cause compute; rank 0 waits for it."""
    result = _run(ddp_train, 60, 1, EXTRA, True).raise_for_status()
    assert [(a.kind, a.rank, a.cause) for a in result.alerts] == [("straggler", 1, "compute")], result.alerts
    fast = step_times.read(RunDir(result.run_dir).steps(0))
    assert fast is not None and fast.collective_total > 0.7 * result.values[1]["spent"], fast.collective_total
