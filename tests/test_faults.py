"""A rank fails, hangs, ignores SIGTERM or leaves processes behind: the call stops every rank and keeps
every line printed (no process is left: the autouse fixture in conftest checks it too).
"""

from __future__ import annotations

import os
import time

import pytest
from faults_common import (
    Recorder,
    alive,
    assert_nothing_left,
    assert_nothing_lost,
    pids_in,
    procs,
    run_dirs,
    run_here,
    steps,
)
from helpers import reported

from air_magic.errors import (
    JobCancelledError,
)
from air_magic.job import JobStatus, RankState
from air_magic.launch.files.rundir import RunDir

pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]


# -- 1. a rank raises while its peer waits in a collective ---------------------------------------


def test_rank_raising_while_its_peer_waits_in_a_collective_stops_the_peer(fault_kernel):
    """The original exception comes back naming rank 1, the peer blocked in all_reduce is stopped, every line printed is
    kept."""
    before = procs()
    out = fault_kernel.execute(
        """
class LossIsNaN(ArithmeticError):
    pass

@distributed(2, timeout=120)
def diverges():
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for i in range(3):
        print(f"rank {rank} step {i}", flush=True)
    if rank == 1:
        time.sleep(0.5)  # let rank 0 block in the collective first
        # a slow exit: rank 0's "Connection closed by peer" then ends its process first, yet is not the cause
        import atexit; atexit.register(time.sleep, 1.5)
        print(f"FAULT_AT {time.time()}", flush=True)
        raise LossIsNaN("loss is nan at step 3")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone
value, error, ended = timed(diverges)
report(error, ended)
"""
    ).check()
    rep = reported(out.stdout)
    assert rep["type"] == "LossIsNaN" and "loss is nan" in rep["message"]
    assert "raised on rank 1 of 2" in rep["notes"][0]
    # Whether rank 0's own "Connection closed by peer" reached the disk before it was stopped is up to the
    # scheduler; what is guaranteed is that it is never named as the cause.
    assert not any("raised on rank 0" in note for note in rep["notes"])
    (run_dir,) = run_dirs(out.stdout)
    assert_nothing_left(before)
    assert_nothing_lost(run_dir, {0: steps(0), 1: steps(1)}, out.stdout)


# -- 3. a hang: the timeout, Cancel and (in test_core) the interrupt stop it ----------------------


def test_collective_that_never_completes_is_stopped_by_the_timeout(fault_kernel):
    """Rank 0 waits forever in all_reduce for a rank that never joins it: the timeout stops both and says so."""
    before = procs()
    out = fault_kernel.execute(
        """
@distributed(2, timeout=15, mlflow=False)
def stuck():
    import os, time, torch, torch.distributed as dist
    rank = int(os.environ["RANK"])
    # Printed before the rendezvous, which waits for the other rank: on a busy machine a late second rank must not
    # keep the first from printing before the timeout.
    for i in range(3):
        print(f"rank {rank} step {i}", flush=True)
    dist.init_process_group("gloo")
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    time.sleep(3600)
value, error, ended = timed(stuck)
report(error, ended)
""",
        timeout=90,
    ).check()
    rep = reported(out.stdout)
    assert rep["type"] == "DistributedTimeoutError" and "timeout of 15 s" in rep["message"]
    (run_dir,) = run_dirs(out.stdout)
    assert_nothing_left(before)
    assert_nothing_lost(run_dir, {0: steps(0), 1: steps(1)}, out.stdout)


def _hangs_without_timeout() -> None:

    print(f"rank {os.environ['RANK']} waiting forever", flush=True)
    time.sleep(3600)


def test_with_no_timeout_the_cancel_path_stops_a_hang():
    """With timeout=None a hung job still ends on Cancel: every rank stopped, KILLED status, output kept."""
    before = procs()
    rec = Recorder(cancel_when="rank 1 waiting forever")
    with pytest.raises(JobCancelledError, match="was cancelled"):
        run_here(_hangs_without_timeout, listener=rec, timeout=None)
    assert rec.result is not None and rec.result.status is JobStatus.KILLED
    assert [rec.states[r][-1] for r in (0, 1)] == [RankState.STOPPED, RankState.STOPPED]
    assert rec.cancelled_at is not None  # how soon after the cancel it ends: bench/faults.py
    assert_nothing_left(before)
    assert_nothing_lost(rec.result.run_dir, {0: ["rank 0 waiting forever"], 1: ["rank 1 waiting forever"]})


# -- 4. ranks that ignore SIGTERM ------------------------------------------------------------------


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace(fault_kernel):
    """A rank and its child that ignore SIGTERM are SIGKILLed after the grace; the call returns the real failure
    promptly."""
    before = procs()
    out = fault_kernel.execute(
        """
@distributed(2, timeout=120)
def stubborn():
    import os, signal, subprocess, sys, time
    rank = int(os.environ["RANK"])
    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM ignored", flush=True))
    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
    child = subprocess.Popen([sys.executable, "-c", ignores])
    print(f"PIDS {os.getpid()} {child.pid}", flush=True)
    for i in range(3):
        print(f"rank {rank} step {i}", flush=True)
    if rank == 1:
        time.sleep(1)
        print(f"FAULT_AT {time.time()}", flush=True)
        raise KeyError("rank 1 lost its shard")
    while True:
        time.sleep(0.1)
value, error, ended = timed(stubborn)
report(error, ended)
"""
    ).check()
    rep = reported(out.stdout)
    assert rep["type"] == "KeyError" and "rank 1 of 2" in rep["notes"][0]
    (run_dir,) = run_dirs(out.stdout)
    assert "SIGTERM ignored" in RunDir(run_dir).log(0).read_text(), "SIGTERM reached the rank and was ignored"
    assert alive(pids_in(run_dir, 0) + pids_in(run_dir, 1)) == []
    assert_nothing_left(before)
    assert_nothing_lost(run_dir, {0: steps(0), 1: steps(1)}, out.stdout)


# -- 5. what the workers start ---------------------------------------------------------------------


def test_a_failure_stops_subprocesses_dataloader_workers_and_detached_processes(fault_kernel):
    """When a rank fails, its peer's subprocess, DataLoader workers, new-session child and a detached daemon with no
    environment are all ended."""
    before = procs()
    out = fault_kernel.execute(
        """
@distributed(2, timeout=120)
def spawns():
    import os, subprocess, time, torch
    from torch.utils.data import DataLoader, Dataset
    rank = int(os.environ["RANK"])
    flag = os.path.join(os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"], "children-up")
    if rank == 1:
        while not os.path.exists(flag):
            time.sleep(0.05)
        print(f"FAULT_AT {time.time()}", flush=True)
        raise RuntimeError("rank 1 fails while rank 0 has children")
    plain = subprocess.Popen(["sleep", "300"])
    session = subprocess.Popen(["sleep", "301"], start_new_session=True)
    # a daemon: its shell exits at once, so it is re-parented, and it carries no environment at all
    run_dir = os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"]
    subprocess.run(["/bin/sh", "-c", "setsid sleep 302 & echo $! > daemon.pid"], env={}, cwd=run_dir, check=True)
    daemon = int(open(os.path.join(run_dir, "daemon.pid")).read())
    class Slow(Dataset):
        def __len__(self): return 10**6
        def __getitem__(self, i):
            time.sleep(0.2)
            return i
    loader = iter(DataLoader(Slow(), num_workers=2))
    next(loader)
    workers = [w.pid for w in loader._workers]
    print("PIDS", plain.pid, session.pid, daemon, *workers, flush=True)
    for i in range(3):
        print(f"rank {rank} step {i}", flush=True)
    open(flag, "w").close()
    for batch in loader:
        pass
value, error, ended = timed(spawns)
report(error, ended)
"""
    ).check()
    rep = reported(out.stdout)
    assert rep["type"] == "RuntimeError" and "rank 1 of 2" in rep["notes"][0]
    (run_dir,) = run_dirs(out.stdout)
    pids = pids_in(run_dir, 0)
    assert len(pids) == 5, pids
    assert alive(pids) == []
    assert_nothing_left(before)
    assert_nothing_lost(run_dir, {0: steps(0)}, out.stdout)
