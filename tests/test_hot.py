"""Hot ranks (keep_alive): the next call of the same world runs in the ranks of the last one, and they always end."""

from __future__ import annotations

import os

import psutil
import pytest
from faults_common import Recorder, alive, run_here
from helpers import leftover_processes, run_id_of, wait_until

from air_magic.owner import owner

pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]


@pytest.fixture(autouse=True)
def releases_hot_ranks_here():
    """Every test ends with the hot ranks released (the leak check would see them otherwise)."""
    yield
    owner().launchers.local.release_hot()


def allreduce(x: int):
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()  # kept for the next call in a hot rank
    return (t.item() + x, os.environ["RANK"], os.environ["WORLD_SIZE"], os.getpid())


def fails_on_rank_1():
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 fails")
    return os.getpid()


def other_backend():
    import torch.distributed as dist

    dist.init_process_group("nccl")


def pids(result) -> list[int]:
    return [v[-1] for v in result.values]


def test_hot_calls_give_the_results_of_cold_ones_in_the_same_processes():
    """Calls with keep_alive return what cold calls return, and the second runs in the first call's processes."""
    cold = run_here(allreduce, 5)
    first = run_here(allreduce, 1, keep_alive=60)
    second = run_here(allreduce, 5, keep_alive=60)
    assert [v[:3] for v in second.values] == [v[:3] for v in cold.values] == [(8.0, "0", "2"), (8.0, "1", "2")]
    assert pids(second) == pids(first) and alive(pids(first)) == pids(first)
    assert pids(cold) != pids(first)


def test_a_hot_rank_that_raised_is_replaced_and_errors_match_cold_ones():
    """The error of a hot call is the cold one's; the ranks of a failed call are not reused."""
    warm = run_here(allreduce, 0, keep_alive=60)
    with pytest.raises(KeyError, match="rank 1 fails") as hot:
        run_here(fails_on_rank_1, keep_alive=60)
    with pytest.raises(KeyError, match="rank 1 fails") as cold:
        run_here(fails_on_rank_1)
    assert hot.value.__notes__[0].split(";")[0] == cold.value.__notes__[0].split(";")[0] == "raised on rank 1 of 2"
    after = run_here(allreduce, 0, keep_alive=60)
    assert not set(pids(after)) & set(pids(warm)), "fresh ranks after a failure"
    assert alive(pids(warm)) == []


def test_another_world_or_environment_starts_fresh_ranks():
    """A changed environment or world size does not run in the hot ranks of another world."""
    base = run_here(allreduce, 0, keep_alive=60)
    other_env = run_here(allreduce, 0, keep_alive=60, env={"AIR_MAGIC_TEST_MARK": "1"})
    one_rank = run_here(allreduce, 0, keep_alive=60, num_accelerators=1)
    again = run_here(allreduce, 0, keep_alive=60)
    assert not set(pids(other_env)) & set(pids(base)) and not set(pids(one_rank)) & set(pids(base))
    assert pids(again) == pids(base), "the first world is still hot"
    assert one_rank.values[0][:3] == (1.0, "0", "1")


def test_init_process_group_with_another_backend_in_a_hot_rank_is_a_clear_error():
    """A hot rank holding a gloo group refuses to make an nccl one, saying how to get fresh ranks."""
    run_here(allreduce, 0, keep_alive=60)
    with pytest.raises(ValueError, match="already holds a 'gloo' process group.*distributed_release"):
        run_here(other_backend, keep_alive=60)


def test_idle_hot_ranks_end_after_keep_alive_and_release_ends_them_at_once():
    """Hot ranks idle past keep_alive exit by themselves; release_hot ends them at once."""
    short = run_here(allreduce, 0, keep_alive=1)
    assert alive(pids(short)) == pids(short)
    wait_until(lambda: alive(pids(short)) == [], 15, "idle hot ranks outlived keep_alive", step=0.2)
    long = run_here(allreduce, 0, keep_alive=600)
    owner().launchers.local.release_hot()
    wait_until(lambda: alive(pids(long)) == [], 15, "release_hot left hot ranks alive", step=0.2)


def test_cancel_during_a_hot_call_ends_the_hot_ranks_and_everything_they_started():
    """Cancel while a hot call runs stops its ranks and their children; the next call gets fresh ranks."""
    before = {p.pid for p in psutil.process_iter()}
    first = run_here(allreduce, 0, keep_alive=60)

    def hangs():
        import subprocess
        import time

        subprocess.Popen(["sleep", "300"])
        print("hanging", flush=True)
        time.sleep(300)

    rec = Recorder(cancel_when="hanging")
    with pytest.raises(Exception, match="cancelled"):
        run_here(hangs, keep_alive=60, listener=rec)
    assert alive(pids(first)) == []
    assert leftover_processes(before, wait=10, kind="job") == []


HELD_MODULE = """
import os, time
deadline = time.monotonic() + 120
while os.path.exists({hold!r}) and time.monotonic() < deadline:
    time.sleep(0.05)
"""
SLOW_HOOK = """
def preload(env):
    with open(env["MARKS"], "a") as f:
        f.write("start\\n")
    import slowwarm
    with open(env["MARKS"], "a") as f:
        f.write("done\\n")
    return []
"""


@pytest.mark.slow
def test_a_hot_call_is_not_held_up_by_the_helpers_warm_up(tmp_path, monkeypatch):
    """A call that arrives while the helper runs a warm-up (here one held until the call is back) starts at once in
    its hot ranks; the warm-up gives way and runs again, to the end, once the helper is idle."""
    (tmp_path / "slowwarm").mkdir()
    (tmp_path / "slowwarm" / "__init__.py").write_text("".join(f"from . import m{i}\n" for i in range(100)))
    for i in range(100):
        (tmp_path / "slowwarm" / f"m{i}.py").write_text("import time\ntime.sleep(0.1)\n")
    # the last module waits while a file `hold` is there (120 s at most): a hot call that waited for the warm-up
    # would come back only after that
    (tmp_path / "slowwarm" / "m99.py").write_text(HELD_MODULE.format(hold=str(tmp_path / "hold")))
    hold = tmp_path / "hold"
    hold.touch()
    (tmp_path / "slowwarmhook.py").write_text(SLOW_HOOK)
    marks = tmp_path / "marks"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    launcher = owner().launchers.local
    launcher.shutdown()  # the next helper finds the hook module on its path
    try:
        first = run_here(allreduce, 0, keep_alive=60)
        launcher.prepare_hooks(["slowwarmhook"], {"MARKS": str(marks)})
        wait_until(marks.exists, 60, "the warm-up never began")
        try:
            second = run_here(allreduce, 0, keep_alive=60)
            assert pids(second) == pids(first)
            assert "done" not in marks.read_text(), "the hot call came back only once the warm-up had finished"
        finally:
            hold.unlink()
        wait_until(lambda: marks.read_text().endswith("done\n"), 120, "the warm-up never ran to its end")
        assert marks.read_text().split() == ["start", "start", "done"]
    finally:
        launcher.release_hot()
        launcher.shutdown()


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_cells_with_keep_alive_log_each_call_to_its_own_run_and_interrupt_or_release_end_them(kernel, workdir):
    """Hot %%distributed cells log metrics to each cell's own MLflow run; Ctrl-C and %distributed_release end the
    ranks."""
    import mlflow

    kernel.execute("%load_ext air_magic").check()
    cell = (
        "%%distributed --gpus 2 --keep-alive 60\n"
        "import os, mlflow\nmlflow.log_metric('step_rank', float(os.environ['RANK']) + {n})\nos.getpid()"
    )
    outs = [kernel.execute(cell.format(n=n)).check() for n in (10, 20)]
    assert outs[0].result == outs[1].result, "the second cell ran in the first cell's processes"
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    for n, out in zip((10, 20), outs):
        run_id = run_id_of(out.stdout)
        values = sorted(m.value for m in client.get_metric_history(run_id, "step_rank"))
        assert values == [n, n + 1], f"run of the call with {n}: {values}"
    hot = eval(outs[1].result)
    # Between calls a hot rank keeps none of MLflow's logging threads: a left-over one held the end of the
    # next call that did not log for 1 s (its queue waited out a 1 s timeout when shut down).
    threads = kernel.execute(
        "%%distributed --gpus 2 --keep-alive 60\nimport os, threading\n"
        "(os.getpid(), [t.name for t in threading.enumerate()])"
    ).check()
    for pid, names in eval(threads.result):
        assert pid in hot and not [n for n in names if "MLflow" in n or "ThreadPoolExecutor" in n], names

    before = {p.pid for p in psutil.process_iter()}
    msg = kernel.send(
        "%%distributed --gpus 2 --keep-alive 60 --no-mlflow\nimport time\nprint('sleeping', flush=True)\n"
        "time.sleep(600)"
    )
    out = kernel.collect(msg, timeout=120, interrupt_when=lambda o: o.stdout.count("] sleeping") == 2)
    assert out.ename == "KeyboardInterrupt"
    assert alive(hot) == [] and leftover_processes(before, wait=10, kind="job") == []

    again = eval(
        kernel.execute("%%distributed --gpus 2 --keep-alive 60 --no-mlflow\nimport os\nos.getpid()").check().result
    )
    assert alive(again) == again and not set(again) & set(hot)
    kernel.execute("%distributed_release").check()
    wait_until(lambda: alive(again) == [], 15, "%distributed_release left hot ranks alive", step=0.2)


def ddp_losses(steps: int) -> list[float]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1 + dist.get_rank())
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dist.destroy_process_group()
    return losses


def test_ddp_training_rerun_on_hot_ranks_gives_the_losses_of_a_fresh_run():
    """The same seeded DDP training gives identical losses fresh, then twice on hot ranks."""
    fresh = run_here(ddp_losses, 20).values
    hot = [run_here(ddp_losses, 20, keep_alive=60).values for _ in range(3)]
    assert hot[0] == hot[1] == hot[2] == fresh
    assert fresh[0][-1] < fresh[0][0]
