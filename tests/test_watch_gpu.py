"""Watching a real DDP loop on GPUs (NCCL): a DataLoader slowed in its input shows as each rank's input wait, the rest
of the step as compute. Skipped on machines without GPUs."""

from __future__ import annotations

import inspect
import os

import cloudpickle
import pytest
from helpers import REAL_NODE, gpu_count, gpu_module_marks

from air_magic import distributed
from air_magic.job import JobResult
from air_magic.launch.files import step_times
from air_magic.launch.files.rundir import RunDir
from air_magic.owner import owner

pytestmark = gpu_module_marks()

#: Seconds each batch waits in the DataLoader's dataset.
SLOW_INPUT = 0.03


def train(steps: int, slow: float) -> int:
    """DDP over a small MLP on this rank's GPU, its batches from a DataLoader whose items take `slow` s each."""
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Dataset

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    model = DDP(nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    class Slow(Dataset):
        def __len__(self) -> int:
            return steps

        def __getitem__(self, i: int) -> torch.Tensor:
            time.sleep(slow)
            return torch.randn(64, 1024)

    for batch in DataLoader(Slow(), batch_size=None):
        opt.zero_grad()
        model(batch.cuda()).pow(2).mean().backward()
        opt.step()
        torch.cuda.synchronize()
    dist.destroy_process_group()
    return dist.get_world_size() if dist.is_initialized() else steps


def _train_on_every_gpu(monkeypatch, tmp_path) -> JobResult:
    """`train` (40 steps, SLOW_INPUT) on every GPU of the node through the owner's door, watched, no MLflow."""
    for key, value in REAL_NODE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AIR_MAGIC_FORCE_CPU", raising=False)
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(owner(), "_ledger", None)  # the node's ledger counted again, with its GPUs
    cloudpickle.register_pickle_by_value(inspect.getmodule(train))
    spec = distributed(mlflow=False, timeout=600)(train).settings.spec(train, (40, SLOW_INPUT), {}, "train")
    result = owner().submit(spec)
    assert result.error is None, result.error
    return result


def test_a_slow_dataloader_shows_as_input_wait_on_every_gpu_rank(monkeypatch, tmp_path):
    """40 DDP steps whose batches each wait 30 ms: every rank's step-times file counts about that as input wait per
    step."""
    result = _train_on_every_gpu(monkeypatch, tmp_path)
    for rank in range(gpu_count()):
        state = step_times.read(RunDir(result.run_dir).steps(rank))
        assert state is not None and state.count >= 35, state
        per_step = state.input_total / state.count
        print(
            f"rank {rank}: {state.count} steps, input {per_step * 1e3:.1f} ms, "
            f"compute {(state.step_total - state.input_total - state.collective_total) / state.count * 1e3:.1f} ms "
            f"a step (pid {os.getpid()})"
        )
        assert SLOW_INPUT * 0.8 <= per_step <= SLOW_INPUT * 3, per_step


@pytest.mark.skipif(gpu_count() < 2, reason="needs two NVIDIA GPUs: an alert compares one GPU rank with another")
def test_gpu_ranks_alike_in_their_input_raise_no_alert(monkeypatch, tmp_path):
    """The same loop on two GPUs or more, every rank's input equally slow: the watch names no straggler and no hang,
    with every rank's steps counted."""
    result = _train_on_every_gpu(monkeypatch, tmp_path)
    assert result.alerts == [], result.alerts
    counts = [step_times.read(RunDir(result.run_dir).steps(rank)) for rank in range(gpu_count())]
    assert all(state is not None and state.count >= 35 for state in counts), counts
