"""Two kernels side by side, a kernel shut down or restarted mid-run, two calls from two threads: nothing left."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from faults_common import (
    alive,
    assert_nothing_left,
    assert_nothing_lost,
    pids_in,
    procs,
    steps,
)
from helpers import leftover_processes, reported

from air_magic.launch.files.rundir import RunDir

pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]


# -- 6 and 8. kernels shut down or restarted mid-run; two kernels side by side ----------------------

FOREVER = """
from air_magic import distributed
@distributed(2, timeout=None)
def forever(tag):
    import os, subprocess, time
    child = subprocess.Popen(["sleep", "300"])
    print("PIDS", os.getpid(), child.pid, flush=True)
    print(tag, "port", os.environ["MASTER_PORT"], "dir", os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"], flush=True)
    for i in range(3):
        print(f"rank {os.environ['RANK']} step {i}", flush=True)
    time.sleep(300)
"""


def _wait_for_logs(runs: Path, tag: str, timeout: float = 90) -> Path:
    """The run directory of the job tagged `tag` once both ranks printed their last step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in runs.glob("*forever*"):
            logs = [RunDir(d).log(r) for r in (0, 1)]
            if all(p.exists() and f"{tag} port" in p.read_text() and "step 2" in p.read_text() for p in logs):
                return d
        time.sleep(0.2)
    raise AssertionError(f"job {tag} did not start in {timeout} s")


def test_two_kernels_run_side_by_side_and_a_shutdown_or_restart_mid_run_leaves_nothing(workdir, new_kernel):
    """Two kernels' jobs get their own ports and run directories; shutting one down and restarting the other mid-run
    leaves no worker."""
    before = procs()
    runs_a, runs_b = workdir / "runs-a", workdir / "runs-b"
    env = {"AIR_MAGIC_DISPLAY": "text", "AIR_MAGIC_WARM": "0"}
    a = new_kernel(env=dict(env, AIR_MAGIC_RUNS_DIR=str(runs_a)))
    b = new_kernel(env=dict(env, AIR_MAGIC_RUNS_DIR=str(runs_b)))
    for k in (a, b):
        k.execute(FOREVER).check()
    a.send("forever.distributed('A')")
    b.send("forever.distributed('B')")
    dir_a, dir_b = _wait_for_logs(runs_a, "A"), _wait_for_logs(runs_b, "B")
    port = {t: RunDir(d).log(0).read_text().split(f"{t} port ")[1].split()[0] for t, d in (("A", dir_a), ("B", dir_b))}
    assert port["A"] != port["B"] and dir_a != dir_b
    pids_a, pids_b = pids_in(dir_a, 0) + pids_in(dir_a, 1), pids_in(dir_b, 0) + pids_in(dir_b, 1)
    assert len(alive(pids_a)) == 4 and len(alive(pids_b)) == 4

    a.kc.stop_channels()
    a.km.shutdown_kernel(now=False)  # shutdown request while the cell runs
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and alive(pids_a):
        time.sleep(0.2)
    assert alive(pids_a) == []
    assert len(alive(pids_b)) == 4, "the other kernel's job was not disturbed"

    b.km.restart_kernel(now=False)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and alive(pids_b):
        time.sleep(0.2)
    assert alive(pids_b) == []
    for d in (dir_a, dir_b):
        assert_nothing_lost(d, {0: steps(0), 1: steps(1)})
    assert leftover_processes(before, wait=10) == []


def test_two_calls_from_two_threads_at_once_do_not_disturb_each_other(fault_kernel):
    """Two threads of one notebook run a gloo job each at the same time: own port, own run directory, right sums."""
    before = procs()
    out = fault_kernel.execute(
        """
@distributed(2, timeout=120)
def summed(k):
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(k * (dist.get_rank() + 1))])
    for _ in range(20):
        dist.all_reduce(t)
        t /= 2
    print(f"job {k} rank {dist.get_rank()} done", flush=True)
    return (t.item(), os.environ["MASTER_PORT"], os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"])
results = {}
threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, summed.distributed(k))) for k in (1, 2)]
[t.start() for t in threads]; [t.join(120) for t in threads]
print("REPORT " + json.dumps(results))
""",
        timeout=180,
    ).check()
    results = reported(out.stdout)
    one, two = results["1"], results["2"]
    assert [r[0] for r in one] == [1.5, 1.5] and [r[0] for r in two] == [3.0, 3.0]  # k * 3 / 2, kept by every round
    assert one[0][1] != two[0][1] and one[0][2] != two[0][2]
    assert_nothing_left(before)
    for k, res in (("1", one), ("2", two)):
        assert_nothing_lost(Path(res[0][2]), {r: [f"job {k} rank {r} done"] for r in (0, 1)}, out.stdout)
