"""Profiling N steps of every rank with real ranks (2 CPU ranks, gloo): the slow rank and its cause named, the traces
merged, the ranks going on after the window; from the decorator and from `%%distributed --profile` in a kernel."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from air_magic import ConfigurationError, DistributedCall, Profile, distributed
from air_magic.job import JobResult
from air_magic.launch.files import profile_windows, step_times
from air_magic.launch.files.rundir import RunDir
from air_magic.owner import owner

pytestmark = pytest.mark.slow

STEPS = 40


def _run(func: Any, *args: Any, **settings: Any) -> JobResult:
    """`func` on 2 CPU ranks through the decorator's `.run` (its default listeners), no MLflow."""
    module = inspect.getmodule(func)
    if module is not None:
        cloudpickle.register_pickle_by_value(module)  # the ranks need not import this test module
    settings = {"num_accelerators": 2, "accelerator_type": "CPU", "mlflow": False, "timeout": 600, **settings}
    return distributed(**settings)(func).run(*args)


def ddp_train(steps: int, slow_rank: int, extra: int) -> int:
    """DDP on a linear layer; `slow_rank` does `extra` more matrix products a step. Returns the steps it took."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import air_magic

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(256, 256))
    x, w = torch.randn(64, 256), torch.randn(256, 256)
    done = 0
    for _ in range(steps):
        y = model(x)
        if rank == slow_rank:
            for _ in range(extra):
                y = y + (x @ w) * 0
        y.sum().backward()
        air_magic.step()
        done += 1
    dist.destroy_process_group()
    return done


#: Matrix products rank 1 does beyond rank 0 in each step: about 20 ms on a CPU core, well above what a rank loses
#: to a busy machine's scheduler in a step (with 30, about 4 ms, rank 0 once lost more and was named slowest).
EXTRA = 150


def test_profile_names_the_rank_slower_in_its_compute_under_ddp(here_runs, capsys):
    """Under DDP, rank 1 doing EXTRA more matrix products a step is the slowest, by its compute, and waits least in the
    all-reduce; the merged trace holds both ranks' events as processes 0 and 1; both ranks finish every step after
    the 5 profiled ones; the text display prints the table."""
    result = _run(ddp_train, STEPS, 1, EXTRA, profile=5).raise_for_status()
    assert result.values == [STEPS, STEPS]  # they went on training after the window
    profile = result.profile
    assert isinstance(profile, Profile)
    assert profile.slowest == (1, "compute"), profile.table()
    assert profile.steps == 5 and profile.first_step == 2
    rows = {int(row["rank"]): row for row in profile.ranks}
    assert set(rows) == {0, 1} and all(
        set(r) == {"rank", "step", "compute", "collective", "input", "idle"} for r in rows.values()
    )
    assert rows[1]["compute"] > rows[0]["compute"] and rows[0]["collective"] > rows[1]["collective"], profile.table()
    for row in rows.values():  # the split adds up to the step (CPU ranks: no GPU to be idle)
        assert row["compute"] + row["collective"] + row["input"] == pytest.approx(row["step"], rel=1e-6)
        assert row["idle"] == 0.0
    assert profile.skew is not None and profile.skew.rank == 1, profile.skew
    mm = {rank: next(op for op in profile.top_ops[rank] if op.name == "aten::mm") for rank in (0, 1)}
    assert mm[1].calls == mm[0].calls + 5 * EXTRA and mm[1].seconds > mm[0].seconds, (
        profile.top_ops
    )  # rank 1's extra work
    assert len(profile.top_ops[0]) == 10
    # each rank's trace and the merged one, in the run directory
    run = RunDir(result.run_dir)
    assert profile.traces == [run.trace(0), run.trace(1)] and profile.trace == run.merged_trace
    merged = json.loads(run.merged_trace.read_bytes())
    events = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        steps = [e["name"] for e in events if e["pid"] == rank and e.get("name", "").startswith("air_magic step ")]
        assert steps == [f"air_magic step {i}" for i in range(2, 7)]
    window = profile_windows.read(run.profile_window(1))
    assert window is not None and (window.first, window.steps, window.asked) == (2, 5, 5)
    watched = step_times.read(run.steps(1))
    # the watch went on counting every step (its first air_magic.step() call starts step 0)
    assert watched is not None and watched.count == STEPS - 1
    out = capsys.readouterr().out
    assert "slowest: rank 1 (compute" in out and "collective ms" in out and str(run.merged_trace) in out


def short_loop(steps: int) -> int:
    """air_magic.step() after each of `steps` all_reduces."""
    import torch
    import torch.distributed as dist

    import air_magic

    dist.init_process_group("gloo")
    t = torch.ones(8)
    for _ in range(steps):
        dist.all_reduce(t)
        air_magic.step()
    dist.destroy_process_group()
    return steps


def test_a_call_shorter_than_the_window_profiles_the_steps_it_had(here_runs):
    """profile=50 over a call of 6 air_magic.step() calls: the window closes at the call's end with the 3 whole steps
    it profiled after its warm-up (the step the call's end cut short is left out), and the blocking all_reduce of each
    is the skew's collective."""
    result = _run(short_loop, 6, profile=50).raise_for_status()
    profile = result.profile
    assert profile is not None and profile.steps == 3
    assert all(row["collective"] > 0 for row in profile.ranks)
    assert profile.skew is not None and profile.skew.collectives == 3


def test_the_magic_profiles_a_cell(loaded_kernel):
    """`%%distributed --profile 3` prints the table after the cell's output; the cell's JobResult holds the Profile."""
    cell = loaded_kernel.execute(
        "%%distributed --gpus 2 --accelerator-type CPU --no-mlflow --profile 3\n"
        "import torch, torch.distributed as dist, air_magic\n"
        "dist.init_process_group('gloo')\n"
        "for _ in range(6):\n"
        "    dist.all_reduce(torch.ones(4)); air_magic.step()\n"
        "dist.destroy_process_group()\n",
        timeout=180,
    ).check()
    assert "profiled 3 step(s) from step 2" in cell.stdout and "collective ms" in cell.stdout, cell.stdout
    magics = "get_ipython().magics_manager.registry['DistributedMagics']"
    assert loaded_kernel.value(f"type({magics}.last_result.profile).__name__") == "'Profile'"
    cell = loaded_kernel.execute("%%distributed --gpus 2 --accelerator-type CPU --profile 0\npass\n")
    assert "UsageError" in cell.stderr and "a whole number of steps to profile, 1 or more" in cell.stderr, cell.stderr


def until_stopped(pause: float) -> int:
    """An all_reduce, a pause and air_magic.step() until the call's Stop (at most 3000 steps); returns the steps."""
    import time

    import torch
    import torch.distributed as dist

    import air_magic

    dist.init_process_group("gloo")
    t, done = torch.ones(8), 0
    while done < 3000:
        stop = torch.tensor([float(air_magic.should_stop())])
        dist.all_reduce(stop)  # every rank stops at the same step
        if stop.item():
            break
        dist.all_reduce(t)
        time.sleep(pause)
        air_magic.step()
        done += 1
    dist.destroy_process_group()
    return done


def test_a_running_background_call_is_profiled_on_demand(here_runs):
    """handle.profile(steps=3) on a spawned call profiles its next 3 steps while it runs, and again later, each with
    its own traces; handle.profiles keeps both, newest last; the call goes on until stopped."""
    cloudpickle.register_pickle_by_value(inspect.getmodule(until_stopped))
    handle = distributed(2, "CPU", mlflow=False, timeout=600)(until_stopped).spawn(0.01)
    first = handle.profile(steps=3, timeout=120)
    second = handle.profile(steps=3, timeout=120)
    handle.stop()
    done = handle.result(timeout=120)
    assert handle.profiles == [first, second]
    assert first.steps == second.steps == 3 and second.first_step > first.first_step
    assert first.trace is not None and second.trace is not None and first.trace != second.trace
    assert first.trace.is_file() and second.trace.is_file()
    assert all(row["collective"] > 0 for row in second.ranks)
    run = RunDir(handle.run_dir)
    windows = [profile_windows.read(run.profile_window(rank, 2)) for rank in (0, 1)]
    assert windows[0] is not None and windows[1] is not None and windows[0].first == windows[1].first  # same steps
    assert second.skew is not None and second.skew.collectives >= 3 * 2  # the loop's two all_reduces a step at least
    assert done[0] == done[1] > second.first_step + 3  # it trained on after both windows
    unwatched = distributed(2, "CPU", mlflow=False, watch=False)(until_stopped).settings.spec(
        until_stopped, (), {}, "f"
    )
    with pytest.raises(ConfigurationError, match="watch=False"):
        DistributedCall(unwatched, owner=owner()).profile(3)
    with pytest.raises(ConfigurationError, match="whole number of steps to profile, 1 or more"):
        handle.profile(0)


def test_a_session_cell_is_profiled_in_the_sessions_ranks(loaded_kernel, releases_hot_ranks):
    """In a session, the cell with --profile 3 is profiled in the ranks the first cell started (their process group
    kept), and the next cell, without it, leaves no new trace."""
    head = "%%distributed --gpus 2 --accelerator-type CPU --no-mlflow --session prof"
    loop = "for _ in range(6):\n    dist.all_reduce(torch.ones(4)); air_magic.step()\n"
    loaded_kernel.execute(
        f"{head}\nimport torch, torch.distributed as dist, air_magic\ndist.init_process_group('gloo')\n{loop}",
        timeout=180,
    ).check()
    cell = loaded_kernel.execute(f"{head} --profile 3\n{loop}", timeout=180).check()
    assert "profiled 3 step(s) from step 2" in cell.stdout, cell.stdout
    magics = "get_ipython().magics_manager.registry['DistributedMagics']"
    assert loaded_kernel.value(f"{magics}.last_result.profile.steps") == "3"
    cell = loaded_kernel.execute(f"{head}\n{loop}", timeout=180).check()
    assert "profiled" not in cell.stdout
    assert loaded_kernel.value(f"{magics}.last_result.profile") == "None"
    run_dir = loaded_kernel.value(f"str({magics}.last_result.run_dir)").strip("'")
    assert not list(Path(run_dir).glob("*trace*"))
