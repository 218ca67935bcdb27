"""Background calls in a real kernel: the kernel is free while the ranks run, results and errors come back at
`result()`, Cancel frees every process, calls at once get their own CPU slots, and a later cell can see a call."""

from __future__ import annotations

import psutil
import pytest

pytestmark = pytest.mark.slow

#: Four CPU worker slots: two calls of 2 ranks run at once, a third waits.
KERNEL_ENV = {"AIR_MAGIC_CPU_SLOTS": "4"}

SETUP = """
import os, pathlib, time
from air_magic import distributed, DistributedCall, JobCancelledError

@distributed(2, accelerator_type="CPU", mlflow=False)
def wait_for(flag, note="working"):
    import os, pathlib, time
    print(note, "on rank", os.environ["RANK"], flush=True)
    while not pathlib.Path(flag).exists():
        time.sleep(0.05)
    return int(os.environ["RANK"])

@distributed(2, accelerator_type="CPU", mlflow=False)
def fails_on_one():
    import os
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch on rank one")
    return 0

def until(check, limit=90):
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def bg_kernel(kernel):
    """The module's kernel with air_magic loaded and the test functions defined."""
    kernel.execute("%load_ext air_magic").check()
    kernel.execute(SETUP).check()
    return kernel


def test_a_cell_runs_while_a_background_calls_ranks_still_run(bg_kernel, workdir):
    """spawn() returns at once; the next cell runs while both ranks wait; result() gives the values by rank."""
    flag = workdir / "go-1"
    bg_kernel.execute(f"h = wait_for.spawn({str(flag)!r})").check()
    out = bg_kernel.execute("until(lambda: 'working' in h.logs(1))\nprint('STATUS', h.status, h.done())").check()
    assert "STATUS running False" in out.stdout
    flag.touch()
    assert bg_kernel.execute("print(h.result())").check().stdout.strip() == "[0, 1]"
    assert bg_kernel.execute("print(h.status, h.job().status.value)").check().stdout.split() == ["finished", "FINISHED"]


def test_an_exception_on_a_rank_is_raised_at_result(bg_kernel):
    """result() raises the rank's own exception, naming the rank, as .distributed would; the status is failed."""
    out = bg_kernel.execute("e = fails_on_one.spawn()\ne.result()")
    assert out.ename == "ValueError"
    assert "bad batch on rank one" in out.traceback and "rank 1 of 2" in out.traceback
    assert bg_kernel.execute("print(e.status)").check().stdout.strip() == "failed"


def test_cancel_stops_every_rank_and_result_raises_job_cancelled(bg_kernel, workdir):
    """cancel() ends every process of the call (the leak check sees none left); result() raises JobCancelledError."""
    bg_kernel.execute(f"c = wait_for.spawn({str(workdir / 'never')!r})\nuntil(lambda: 'working' in c.logs(1))").check()
    pids = eval(bg_kernel.execute("print(sorted(c.ctx.pids.values()))").check().stdout)
    out = bg_kernel.execute("c.cancel()\nc.result()")
    assert out.ename == "JobCancelledError"
    assert bg_kernel.execute("print(c.status)").check().stdout.strip() == "cancelled"
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=15)
    assert not alive


def test_two_calls_at_once_get_disjoint_slots_and_a_third_waits_for_them(bg_kernel, workdir):
    """With 4 CPU slots, two 2-rank calls run at once on their own slots; a third is waiting (and says for what)
    until one ends, then runs."""
    flag = str(workdir / "go-3")
    spawned = bg_kernel.execute(
        f"a = wait_for.spawn({flag!r})\nb = wait_for.spawn({flag!r})\nc3 = wait_for.spawn({flag!r})\n"
        "until(lambda: 'working' in a.logs(1) and 'working' in b.logs(1))"
    ).check()
    # The notice is normal output: Jupyter draws stderr like an error.
    assert "waits for 2 CPU slot(s)" in spawned.stdout and "waits for" not in spawned.stderr
    out = bg_kernel.execute("print(a.claim.units, b.claim.units, c3.status, c3.waiting_for)").check()
    assert "waiting" in out.stdout and "held by call" in out.stdout
    assert "waiting" in bg_kernel.execute("%distributed_calls").check().stdout
    first, second = eval(bg_kernel.execute("print([a.claim.units, b.claim.units])").check().stdout)
    assert len(first) == len(second) == 2 and not set(first) & set(second)
    (workdir / "go-3").touch()
    out = bg_kernel.execute("print(a.result(), b.result(), c3.result(), c3.status)").check()
    assert out.stdout.strip() == "[0, 1] [0, 1] [0, 1] finished"


def test_a_foreground_call_waiting_for_slots_says_so_on_stdout(bg_kernel, workdir):
    """A foreground call whose CPU slots two background calls hold prints what it waits for as normal output (not
    stderr, which Jupyter draws red), then runs once they end."""
    flag = str(workdir / "go-fg")
    bg_kernel.execute(
        f"a = wait_for.spawn({flag!r})\nb = wait_for.spawn({flag!r})\n"
        "until(lambda: 'working' in a.logs(1) and 'working' in b.logs(1))"
    ).check()
    out = bg_kernel.execute(
        "import threading\nfrom air_magic.owner import owner\n"
        "def free_when_waiting():\n"
        "    until(lambda: bool(owner().ledger._queue))  # the foreground call is in the waiting line\n"
        f"    pathlib.Path({flag!r}).touch()\n"
        "threading.Thread(target=free_when_waiting, daemon=True).start()\n"
        f"print('VALUES', wait_for.distributed({flag!r}), a.result(), b.result())"
    ).check()
    assert "waits for 2 CPU slot(s)" in out.stdout and "waits for" not in out.stderr
    assert "VALUES [0, 1] [0, 1] [0, 1]" in out.stdout


def test_distributed_show_in_a_new_cell_shows_lines_written_before_it(bg_kernel, workdir):
    """A later cell's %distributed_show prints what every rank wrote so far; once the call ended, its record."""
    flag = workdir / "go-4"
    bg_kernel.execute(f"s = wait_for.spawn({str(flag)!r}, note='written-early')").check()
    bg_kernel.execute("until(lambda: 'written-early' in s.logs(0) and 'written-early' in s.logs(1))").check()
    shown = bg_kernel.execute("%distributed_show").check()
    assert "[rank 0] written-early on rank 0" in shown.stdout and "[rank 1] written-early on rank 1" in shown.stdout
    flag.touch()
    bg_kernel.execute("s.result()").check()
    record = bg_kernel.execute("%distributed_show").check()
    text = "".join(d["data"].get("text/plain", "") for d in record.displays)
    assert "finished" in text and "written-early on rank 1" in text


def test_distributed_show_of_an_unknown_call_lists_the_known_ones(bg_kernel):
    """An id that is no call of this kernel is a usage error that lists the ids there are."""
    out = bg_kernel.execute("%distributed_show 999")
    assert "there is no call 999" in out.stderr and "known calls:" in out.stderr


def test_background_cell_stores_its_handle_and_a_finished_call_is_rebuilt_from_its_run_directory(bg_kernel):
    """`%%distributed --background --out h` stores the handle; from_run_dir gives the same values and exit codes."""
    bg_kernel.execute(
        "%%distributed --background --out cellcall --gpus 2 --accelerator-type CPU --no-mlflow\n"
        "import os\nprint('cell rank', os.environ['RANK'])\nint(os.environ['RANK']) * 10"
    ).check()
    out = bg_kernel.execute(
        "print(cellcall.result())\nagain = DistributedCall.from_run_dir(cellcall.run_dir)\n"
        "print(again.status, again.result(), [r.returncode for r in again.job().ranks], 'cell rank 1' in again.logs(1))"
    ).check()
    assert out.stdout.splitlines() == ["[0, 10]", "finished [0, 10] [0, 0] True"]


def test_kernel_shutdown_ends_background_ranks(workdir, new_kernel):
    """Shutting the kernel down while a background call runs leaves no rank, helper or child behind."""
    kernel = new_kernel()
    kernel.execute("%load_ext air_magic").check()
    kernel.execute(SETUP).check()
    kernel.execute(f"h = wait_for.spawn({str(workdir / 'never')!r})\nuntil(lambda: 'working' in h.logs(1))").check()
    pids = eval(kernel.execute("print(sorted(h.ctx.pids.values()))").check().stdout)
    kernel.shutdown(check=True)
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=15)
    assert not alive


SWEEP = """
from air_magic import sweep

def scored(lr):
    import mlflow
    mlflow.log_metric("score", lr * 10)
    return lr

trials = sweep(scored, [{"lr": 0.1}, {"lr": 0.3}], num_accelerators=2, accelerator_type="CPU")
values = trials.results()
client = __import__("mlflow").MlflowClient()
until(lambda: client.get_run(trials.run_id).info.status == "FINISHED")
children = [c.run_id for c in trials.calls]
parents = {client.get_run(r).data.tags.get("mlflow.parentRunId") for r in children}
print("REPORT", __import__("json").dumps({
    "values": values, "statuses": trials.statuses, "parents": sorted(parents), "parent": trials.run_id,
    "chart": trials.chart()["text/plain"],
}))
"""


def test_a_sweep_runs_its_trials_as_child_runs_of_one_parent_and_compares_their_last_metrics(bg_kernel):
    """Each trial runs and finishes as a child MLflow run of the sweep's parent run, which ends FINISHED; the chart
    names each trial with its last metric value."""
    from helpers import reported

    got = reported(bg_kernel.execute(SWEEP, timeout=300).check().stdout)
    assert got["values"] == [[0.1, 0.1], [0.3, 0.3]] and got["statuses"] == ["finished", "finished"]
    assert got["parents"] == [got["parent"]]
    assert "lr=0.1 1" in got["chart"] and "lr=0.3 3" in got["chart"]
