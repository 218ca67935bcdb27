"""Faults and bad input: every scenario ends with nothing left running and nothing printed lost.

The notebook-facing scenarios run in a real kernel (text display, so the
`[rank N]` lines can be read); the ones where the notebook plays no part
drive the same runner from this process. The autouse fixture in conftest
also fails any test that leaves a process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from faults_common import (
    Recorder,
    alive,
    assert_nothing_left,
    assert_nothing_lost,
    pids_in,
    run_dirs,
    run_here,
)
from helpers import Kernel, leftover_processes

from air_magic import accelerators, distributed
from air_magic.errors import (
    ConfigurationError,
    JobCancelledError,
    RunDirectoryFullError,
)
from air_magic.job import JobStatus, RankState
from air_magic.launch.rundir import RunDir

SETUP = """
import os, sys, time, json, threading
from air_magic import distributed

def timed(fn, *args, **kwargs):
    try:
        value, error = fn.distributed(*args, **kwargs), None
    except BaseException as exc:
        value, error = None, exc
    return value, error, time.time()

def report(error, ended):
    print("REPORT " + json.dumps({"type": type(error).__name__, "message": str(error),
          "notes": getattr(error, "__notes__", []), "ended": ended}))
"""


pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]


@pytest.fixture(scope="module")
def nb(kernel):
    kernel.execute(SETUP).check()
    # start the kernel's supervisor before the first test, so its leak check does not wait on it
    kernel.execute("distributed(2, mlflow=False)(lambda: 0).distributed()").check()
    return kernel


def procs() -> set[int]:
    return {p.pid for p in psutil.process_iter()}


def reported(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("REPORT ")][-1][7:])


def steps(rank: int, n: int = 3) -> list[str]:
    return [f"rank {rank} step {i}" for i in range(n)]


# -- 1. a rank raises while its peer waits in a collective ---------------------------------------


def test_rank_raising_while_its_peer_waits_in_a_collective_stops_the_peer(nb):
    """The original exception comes back naming rank 1, the peer blocked in all_reduce is stopped, every line printed is
    kept."""
    before = procs()
    out = nb.execute(
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


def test_collective_that_never_completes_is_stopped_by_the_timeout(nb):
    """Rank 0 waits forever in all_reduce for a rank that never joins it: the timeout stops both and says so."""
    before = procs()
    out = nb.execute(
        """
@distributed(2, timeout=10, mlflow=False)  # room for the ranks to print first, even on a busy machine
def stuck():
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for i in range(3):
        print(f"rank {rank} step {i}", flush=True)
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    time.sleep(3600)
value, error, ended = timed(stuck)
report(error, ended)
""",
        timeout=90,
    ).check()
    rep = reported(out.stdout)
    assert rep["type"] == "DistributedTimeoutError" and "timeout of 10 s" in rep["message"]
    (run_dir,) = run_dirs(out.stdout)
    assert_nothing_left(before)
    assert_nothing_lost(run_dir, {0: steps(0), 1: steps(1)}, out.stdout)


def _hangs_without_timeout() -> None:
    import os
    import time

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


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace(nb):
    """A rank and its child that ignore SIGTERM are SIGKILLed after the grace; the call returns the real failure
    promptly."""
    before = procs()
    out = nb.execute(
        """
@distributed(2, timeout=120)
def stubborn():
    import os, signal, subprocess, sys, time
    rank = int(os.environ["RANK"])
    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM ignored", flush=True))
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"])
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


def test_a_failure_stops_subprocesses_dataloader_workers_and_detached_processes(nb):
    """When a rank fails, its peer's subprocess, DataLoader workers, new-session child and a detached daemon with no
    environment are all ended."""
    before = procs()
    out = nb.execute(
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
    subprocess.run(["/bin/sh", "-c", "setsid sleep 302 & echo $! > daemon.pid"], env={}, cwd=os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"], check=True)
    daemon = int(open(os.path.join(os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"], "daemon.pid")).read())
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


def test_two_kernels_run_side_by_side_and_a_shutdown_or_restart_mid_run_leaves_nothing(workdir):
    """Two kernels' jobs get their own ports and run directories; shutting one down and restarting the other mid-run
    leaves no worker."""
    before = procs()
    runs_a, runs_b = workdir / "runs-a", workdir / "runs-b"
    env = {"AIR_MAGIC_DISPLAY": "text", "AIR_MAGIC_WARM": "0"}
    a = Kernel(workdir, env=dict(env, AIR_MAGIC_RUNS_DIR=str(runs_a)))
    b = Kernel(workdir, env=dict(env, AIR_MAGIC_RUNS_DIR=str(runs_b)))
    try:
        for k in (a, b):
            k.execute(FOREVER).check()
        a.send("forever.distributed('A')")
        b.send("forever.distributed('B')")
        dir_a, dir_b = _wait_for_logs(runs_a, "A"), _wait_for_logs(runs_b, "B")
        port = {
            t: RunDir(d).log(0).read_text().split(f"{t} port ")[1].split()[0] for t, d in (("A", dir_a), ("B", dir_b))
        }
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
    finally:
        for k in (a, b):
            k.kc.stop_channels()
            if k.km.has_kernel:
                k.km.shutdown_kernel(now=True)
    assert leftover_processes(before, wait=10) == []


def test_two_calls_from_two_threads_at_once_do_not_disturb_each_other(nb):
    """Two threads of one notebook run a gloo job each at the same time: own port, own run directory, right sums."""
    before = procs()
    out = nb.execute(
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


# -- 7. the rendezvous port ------------------------------------------------------------------------


def _try_to_take_the_port() -> dict:
    import os

    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    taken = {}
    for host in ("127.0.0.1", "0.0.0.0"):
        s = socket.socket()
        try:
            s.bind((host, port))
            taken[host] = "bound"
        except OSError as exc:
            taken[host] = exc.errno
        finally:
            s.close()
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} joined on {port}", flush=True)
    return {"port": port, "taken": taken, "world": dist.get_world_size()}


def test_the_master_port_is_held_from_choice_to_use_so_no_program_can_take_it():
    """MASTER_PORT is bound by the launcher before any rank starts: another program cannot take it, and ranks still
    join."""
    import errno

    before = procs()
    rec = Recorder()
    result = run_here(_try_to_take_the_port, listener=rec)
    for value in result.values:
        assert value["taken"] == {"127.0.0.1": errno.EADDRINUSE, "0.0.0.0": errno.EADDRINUSE}
        assert value["world"] == 2
    assert_nothing_left(before)
    port = result.values[0]["port"]
    assert_nothing_lost(result.run_dir, {r: [f"rank {r} joined on {port}"] for r in (0, 1)})


def _joins_late() -> int:
    import os
    import time

    import torch.distributed as dist

    print(f"rank {os.environ['RANK']} will join on {os.environ['MASTER_PORT']}", flush=True)
    time.sleep(1.5)
    dist.init_process_group("gloo")
    return dist.get_rank()


class _KillsTheStore(Recorder):
    """Kills whatever listens on the job's MASTER_PORT (the store) as soon as a rank names the port."""

    def on_output(self, rank: int, text: str) -> None:
        super().on_output(rank, text)
        if self.cancelled_at is None and "will join on" in text:
            port = int(text.split("will join on ")[1].split()[0])
            for conn in psutil.net_connections("tcp"):
                if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                    os.kill(conn.pid, 9)
                    self.cancelled_at = time.time()


def test_a_rendezvous_store_that_dies_stops_the_job_with_a_clear_message_instead_of_a_long_wait():
    """If the store on MASTER_PORT is killed before the ranks join, the call fails at once and says so."""
    before = procs()
    rec = _KillsTheStore()
    with pytest.raises(Exception, match="rendezvous store") as info:
        run_here(_joins_late, listener=rec, timeout=120)
    assert rec.cancelled_at is not None
    assert "was killed by signal 9" in str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert_nothing_left(before)
    assert rec.result is not None
    assert_nothing_lost(rec.result.run_dir, {r: [f"rank {r} will join on"] for r in (0, 1)})


# -- 9. return values and exceptions that do not travel ---------------------------------------------


def test_unpicklable_returns_a_gigabyte_and_unpicklable_exceptions_give_a_result_or_a_clear_error(nb):
    """A lock returned, 1 GiB returned by rank 0, an exception that will not pickle or whose str() fails: each is a
    value or a clear error."""
    before = procs()
    out = nb.execute(
        """
class NoPickle(Exception):
    def __reduce__(self):
        raise TypeError("this exception refuses to be pickled")
class Unloadable:
    def __reduce__(self):  # pickles on the rank, fails when the notebook unpickles it
        return (int, ("not a number",))
class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str() is broken")
@distributed(2, timeout=180)
def gives(kind):
    import os, threading
    rank = int(os.environ["RANK"])
    print(f"rank {rank} {kind}", flush=True)
    if rank == 0 and kind == "lock":
        return threading.Lock()
    if rank == 0 and kind == "big":
        return b"x" * 2**30
    if rank == 1 and kind == "nopickle":
        raise NoPickle("cannot travel")
    if rank == 1 and kind == "badstr":
        raise BadStr()
    if rank == 1 and kind == "unloadable":
        return Unloadable()
    return rank
summary = {}
for kind in ("lock", "big", "nopickle", "badstr", "unloadable"):
    value, error, ended = timed(gives, kind)
    summary[kind] = {"error": type(error).__name__, "text": "" if error is None or kind == "badstr" else str(error),
                     "notes": getattr(error, "__notes__", []),
                     "value": None if value is None else [len(v) if isinstance(v, bytes) else v for v in value]}
    del value
print("REPORT " + json.dumps(summary))
""",
        timeout=240,
    ).check()
    got = reported(out.stdout)
    assert got["lock"]["error"] == "SerializationError" and "return value of rank 0" in got["lock"]["text"]
    assert "could not be pickled" in got["lock"]["text"]
    assert got["big"] == {"error": "NoneType", "text": "", "notes": [], "value": [2**30, 1]}
    assert got["nopickle"]["error"] == "RankFailedError"
    assert "NoPickle: cannot travel" in got["nopickle"]["text"] and "rank 1" in got["nopickle"]["notes"][0]
    assert got["badstr"]["error"] == "BadStr" and "rank 1 of 2" in got["badstr"]["notes"][0]
    assert got["unloadable"]["error"] == "SerializationError"
    assert "return value of rank 1 could not be rebuilt" in got["unloadable"]["text"]
    assert "invalid literal for int()" in got["unloadable"]["text"]
    assert_nothing_left(before)
    dirs = run_dirs(out.stdout)
    assert len(dirs) == 5
    # Where one rank fails, the other may be stopped before it printed anything: only the lines a rank certainly
    # wrote (both ranks when both returned, else the failing rank's) are checked.
    failing = {"lock": 0, "nopickle": 1, "badstr": 1}
    for d, kind in zip(dirs, ("lock", "big", "nopickle", "badstr", "unloadable")):
        ranks = (failing[kind],) if kind in failing else (0, 1)
        assert_nothing_lost(d, {r: [f"rank {r} {kind}"] for r in ranks}, out.stdout)


# -- 10. arguments ---------------------------------------------------------------------------------


def test_lambdas_and_closures_work_and_unpicklable_or_huge_arguments_are_named(nb):
    """A lambda and a closure from the notebook run on every rank; a socket argument is named before anything starts; a
    huge tensor warns with its size."""
    before = procs()
    out = nb.execute(
        """
import socket, warnings, torch
def make_scaler(k):
    def scale(x):
        return k * x
    return scale
@distributed(2, timeout=120)
def applies(f, g, data):
    import os
    r = int(os.environ["RANK"])
    print(f"rank {r} applies", flush=True)
    return f(r) + g(r) + float(data.sum())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    big = torch.ones(300 * 2**20 // 4)  # 300 MiB of float32
    values = applies.distributed(lambda x: x + 100, make_scaler(10), big)
    del big
s = socket.socket()
_, error, _ = timed(applies, s, s, None)
s.close()
print("REPORT " + json.dumps({"values": values, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
                              "error": type(error).__name__, "text": str(error)}))
""",
        timeout=180,
    ).check()
    got = reported(out.stdout)
    assert got["values"] == [100 + 0 + 300 * 2**18, 101 + 10 + 300 * 2**18]
    (warning,) = [w for w in got["warnings"] if "PayloadSizeWarning" in w]
    assert "300 MiB" in warning
    assert got["error"] == "SerializationError"
    assert "positional argument 0 (socket)" in got["text"] and "positional argument 1 (socket)" in got["text"]
    dirs = run_dirs(out.stdout)
    assert len(dirs) == 1, "the socket call started nothing"
    assert_nothing_left(before)
    assert_nothing_lost(dirs[0], {r: [f"rank {r} applies"] for r in (0, 1)}, out.stdout)


# -- 11. bad settings ------------------------------------------------------------------------------

BAD_SETTINGS = [
    ({"num_accelerators": 0}, "num_accelerators must be at least 1"),
    ({"num_accelerators": -2}, "num_accelerators must be at least 1"),
    ({"num_accelerators": 1.5}, "num_accelerators must be a positive whole number"),
    ({"num_accelerators": "2"}, "num_accelerators must be a positive whole number"),
    ({"accelerator_type": "TPU_8xV5"}, "is not understood"),
    ({"accelerator_type": "GPU_2xH100"}, "none were detected"),
    ({"accelerator_type": 2}, "accelerator_type must be a string"),
    ({"timeout": True}, "timeout must be a number of seconds"),
    ({"timeout": 0}, "timeout must be more than 0 seconds"),
    ({"timeout": -1}, "timeout must be more than 0 seconds"),
    ({"timeout": "1h"}, "timeout must be a number of seconds"),
    ({"timeout": float("nan")}, "timeout must be more than 0 seconds"),
]


def test_bad_settings_are_clear_errors_and_start_nothing(tmp_path, monkeypatch):
    """Every bad count, type or timeout raises a ConfigurationError naming the setting, with no run directory or process
    made."""
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path / "runs"))
    before = procs()
    for settings, message in BAD_SETTINGS:
        with pytest.raises(ConfigurationError, match=message):
            distributed(**settings)(print)
        with pytest.raises(ConfigurationError, match=message):
            distributed(num_accelerators=2, accelerator_type="CPU")(print).with_overrides(**settings)
    gpus = accelerators.Node(2, "H100")
    with pytest.raises(ConfigurationError, match="this node has 2 GPU"):
        accelerators.resolve(3, None, gpus)
    with pytest.raises(ConfigurationError, match="does not match this node, which has 'GPU_2xH100'"):
        accelerators.resolve(None, "GPU_2xA100", gpus)
    with pytest.warns(ResourceWarning, match="CPU workers on a machine with"):
        distributed(num_accelerators=(os.cpu_count() or 1) + 1, accelerator_type="CPU")(print)
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []
    assert leftover_processes(before, wait=0) == []


# -- 12. awkward output ----------------------------------------------------------------------------


def test_odd_bytes_unfinished_lines_and_progress_bars_are_kept_and_shown(nb):
    """Invalid UTF-8, a last line with no newline, carriage-return progress bars and C-level writes crash nothing and
    are all in the logs."""
    before = procs()
    out = nb.execute(
        """
@distributed(2, timeout=120)
def awkward():
    import os, sys
    rank = int(os.environ["RANK"])
    os.write(1, b"raw \\xff\\xfe bytes from rank %d\\n" % rank)
    for pct in range(0, 101, 25):
        sys.stdout.write(f"\\rprogress {pct}%")
        sys.stdout.flush()
    sys.stdout.write("\\n")
    print(f"to stderr from rank {rank}", file=sys.stderr)
    os.write(2, b"C-level write from rank %d\\n" % rank)
    sys.stdout.write(f"no newline at the end from rank {rank}")
    return rank
value, error, ended = timed(awkward)
print("REPORT " + json.dumps({"value": value, "error": type(error).__name__}))
"""
    ).check()
    assert reported(out.stdout) == {"value": [0, 1], "error": "NoneType"}
    (run_dir,) = run_dirs(out.stdout)
    for rank in (0, 1):
        log = RunDir(run_dir).log(rank).read_bytes()
        assert b"raw \xff\xfe bytes from rank %d\n" % rank in log
        assert b"\rprogress 0%\rprogress 25%\rprogress 50%\rprogress 75%\rprogress 100%\n" in log
        assert f"[rank {rank}] raw \ufffd\ufffd bytes from rank {rank}" in out.stdout
        assert "progress 100%" in out.stdout
    printed = {
        r: [f"to stderr from rank {r}", f"C-level write from rank {r}", f"no newline at the end from rank {r}"]
        for r in (0, 1)
    }
    assert_nothing_left(before)
    assert_nothing_lost(run_dir, printed, out.stdout)


def _floods(megabytes: int) -> str:
    import hashlib
    import os
    import sys

    digest = hashlib.sha256()
    if os.environ["RANK"] == "0":
        block = "".join(f"line {i:07d} " + "y" * 86 + "\n" for i in range(10_000)).encode()  # 1 MB
        for _ in range(megabytes):
            sys.stdout.buffer.write(block)
            digest.update(block)
        sys.stdout.flush()
    return digest.hexdigest()


def test_a_200_mb_flood_from_one_rank_reaches_the_log_and_the_listeners_in_full():
    """200 MB printed by one rank is in its log byte for byte and every character reaches the listeners."""
    before = procs()
    rec = Recorder()
    result = run_here(_floods, 200, listener=rec)
    import hashlib

    log = RunDir(result.run_dir).log(0)
    digest = hashlib.sha256()
    with open(log, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    assert digest.hexdigest() == result.values[0]
    assert log.stat().st_size == rec.chars[0] == 200 * 1_000_000
    assert_nothing_left(before)
    assert_nothing_lost(result.run_dir, {0: ["line 0000000 ", "line 0009999 "]})
    shutil.rmtree(result.run_dir)  # 200 MB: do not keep it in pytest's temporary directories


# -- 13. disk full ---------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs to hold the run directories (skipped where mounting is not allowed)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}); run as root to test a full disk")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fills_the_disk() -> None:
    import os
    import time

    rank = int(os.environ["RANK"])
    print(f"rank {rank} before the disk fills", flush=True)
    if rank == 0:
        for i in range(100_000):
            print(f"{i:06d} " + "z" * 90)
    time.sleep(300)


def _returns_too_much() -> bytes:
    import os

    return b"r" * (3 << 20) if os.environ["RANK"] == "1" else b""


def _fills_the_disk_then_raises(where: str) -> None:
    import os

    fd = os.open(os.path.join(where, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"f" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)
    raise ValueError("the real error, raised with the disk full")


def test_a_rank_that_fails_on_a_full_disk_still_reports_its_own_exception(tiny_disk, monkeypatch):
    """Room for the error record is set aside when the run starts, so a full disk cannot swallow the exception."""
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tiny_disk))
    with pytest.raises(RunDirectoryFullError, match="is full") as info:
        run_here(_fills_the_disk_then_raises, str(tiny_disk), num_accelerators=1, timeout=120)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "the real error, raised with the disk full"
    assert "raised on rank 0" in "\n".join(cause.__notes__)
    (run_dir,) = [p for p in tiny_disk.iterdir() if p.is_dir()]
    assert json.loads(RunDir(run_dir).error(0).read_text())["type"] == "builtins.ValueError"


def test_an_error_record_too_long_for_its_reserve_keeps_the_end_of_its_traceback(tmp_path):
    """A huge message and traceback still fit the space set aside: the record stays readable and keeps where it
    failed."""
    from air_magic.launch.errorfile import read_error_file, write_error_file

    run = RunDir(tmp_path)
    run.reserve_error_record(0)
    size = run.error_reserve(0).stat().st_size

    def deep(n: int) -> None:
        if n == 0:
            raise RuntimeError("\u00e9" * 20_000 + " the end of the message")
        deep(n - 1)

    try:
        deep(600)
    except RuntimeError as exc:
        write_error_file(run.error(0), run.error_pickle(0), exc, reserve=run.error_reserve(0))
    assert not run.error_reserve(0).exists() and run.error(0).stat().st_size <= size
    record = json.loads(run.error(0).read_text())
    text = record["traceback"]
    assert text.startswith("Traceback (most recent call last):") and "characters cut to fit the error record" in text
    assert text.rstrip().endswith("the end of the message") and record["type"] == "builtins.RuntimeError"
    assert len(record["message"]) == 4096
    rebuilt = read_error_file(run.error(0), run.error_pickle(0), 0)
    assert isinstance(rebuilt, RuntimeError)


def test_a_run_that_succeeds_gives_back_the_room_set_aside_for_errors(here_runs):
    """The space reserved for error records is released when ranks return: a finished run holds no reservation."""
    result = run_here(_returns_too_much)  # a small result on every rank but 1; enough room here for rank 1's
    assert [len(r.value) for r in result.ranks] == [0, 3 << 20]
    assert sorted(p.name for p in result.run_dir.glob("*.reserved")) == []


def test_a_full_disk_under_the_run_directory_is_a_clear_error_and_stops_every_worker(tiny_disk, monkeypatch):
    """When the run directory's disk fills up, the call stops every rank and names the disk, the free space and the
    fix."""
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tiny_disk))
    before = procs()
    # a result larger than the disk: a clear error, and the half-written result does not keep the disk full
    with pytest.raises(OSError, match="could not be written") as big:
        run_here(_returns_too_much, timeout=120)
    (run_dir,) = [p for p in tiny_disk.iterdir() if p.is_dir()]
    # rank 0's tiny result may meet the full disk too: rank 1 is then named among the ranks that failed
    told = str(big.value) + "\n".join(getattr(big.value, "__notes__", []))
    assert list(run_dir.glob("*.tmp")) == [] and "rank 1" in told
    rec = Recorder()
    with pytest.raises(RunDirectoryFullError, match="is full") as info:
        run_here(_fills_the_disk, listener=rec, timeout=120)
    assert "AIR_MAGIC_RUNS_DIR" in str(info.value) and str(tiny_disk) in str(info.value)
    assert rec.result is not None and rec.result.status is JobStatus.FAILED
    assert_nothing_left(before)
    assert_nothing_lost(rec.result.run_dir, {r: [f"rank {r} before the disk fills"] for r in (0, 1)})
    assert list(rec.result.run_dir.glob("*.reserved")) == [], "stopped ranks' reserves are given back"
    # with the disk still full, the next call fails before starting anything, and says why
    with pytest.raises(Exception, match="No space left|is full"):
        run_here(_fills_the_disk, timeout=120)
    assert leftover_processes(before, wait=0, kind="job") == []
