"""The @distributed front door and the runner, driven from a real Jupyter kernel."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest
from faults_common import run_here
from helpers import leftover_processes, wait_until

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow

SETUP = """
import os, time
from air_magic import distributed
"""


@pytest.fixture(scope="module")
def text_kernel(kernel):
    """The module's kernel (plain-text display) with `distributed` imported."""
    kernel.execute(SETUP).check()
    return kernel


def test_notebook_function_with_class_and_helper_all_reduces_on_two_ranks(text_kernel):
    """A function from one cell, using a class and a helper from others, all-reduces over gloo and returns per rank."""
    text_kernel.execute("class Scale:\n    def __init__(self, k):\n        self.k = k\n").check()
    text_kernel.execute("def helper(x):\n    return x * 10\n").check()
    text_kernel.execute(
        """
@distributed(num_accelerators=2)
def train(offset, scale):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} sees {t.item()}")
    return helper(offset) + scale.k * t.item() + dist.get_rank()
"""
    ).check()
    out = text_kernel.execute("results = train.distributed(1, Scale(2)); results").check()
    assert out.result == "[16.0, 17.0]"
    assert "[rank 0] rank 0 sees 3.0" in out.stdout
    assert "[rank 1] rank 1 sees 3.0" in out.stdout


def test_workers_get_torchrun_variables_and_the_callers_context(text_kernel, workdir):
    """Each rank sees RANK, LOCAL_RANK, WORLD_SIZE, ..., and the notebook's cwd, sys.path and environment at call
    time."""
    sub = workdir / "elsewhere"
    sub.mkdir(exist_ok=True)
    text_kernel.execute(
        f"""
import sys
os.chdir({str(sub)!r})
os.environ["MY_SETTING"] = "42"
sys.path.append("/tmp/air-magic-extra-path")
@distributed(num_accelerators=3)
def context():
    import os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"]
    keys.append("MY_SETTING")
    seen = {{"cwd": os.getcwd(), "path": "/tmp/air-magic-extra-path" in sys.path, "pid": os.getpid()}}
    return {{k: os.environ.get(k) for k in keys}} | seen
ctx = context.distributed()
os.chdir({str(workdir)!r})
import json; print(json.dumps(ctx))
"""
    ).check()
    ctx = json.loads(out_line(text_kernel.execute("print(json.dumps(ctx))").check().stdout))
    assert [c["RANK"] for c in ctx] == ["0", "1", "2"]
    assert [c["LOCAL_RANK"] for c in ctx] == ["0", "1", "2"]
    assert {c["WORLD_SIZE"] for c in ctx} == {"3"} and {c["LOCAL_WORLD_SIZE"] for c in ctx} == {"3"}
    assert {c["NODE_RANK"] for c in ctx} == {"0"} and {c["MASTER_ADDR"] for c in ctx} == {"127.0.0.1"}
    assert len({c["MASTER_PORT"] for c in ctx}) == 1 and int(ctx[0]["MASTER_PORT"]) > 0
    assert {c["MY_SETTING"] for c in ctx} == {"42"}
    assert {c["cwd"] for c in ctx} == {str(sub)}
    assert all(c["path"] for c in ctx)
    assert len({c["pid"] for c in ctx}) == 3 and text_kernel.pid not in {c["pid"] for c in ctx}
    port2 = text_kernel.execute("context.distributed()[0]['MASTER_PORT']").check().result
    assert port2.strip("'") != ctx[0]["MASTER_PORT"], "a fresh port is chosen per call"


def out_line(text: str) -> str:
    return [line for line in text.splitlines() if line.startswith("[")][-1]


def test_cuda_touched_in_the_notebook_and_two_calls_in_a_row(text_kernel):
    """After torch ran in the kernel, two calls in a row still work (workers are never forks of the kernel)."""
    text_kernel.execute("import torch; x = torch.zeros(1)").check()
    text_kernel.execute("@distributed(2)\ndef rank():\n    import os\n    return int(os.environ['RANK'])").check()
    assert text_kernel.execute("rank.distributed()").check().result == "[0, 1]"
    assert text_kernel.execute("rank.distributed()").check().result == "[0, 1]"


def test_rank_exception_keeps_type_names_rank_and_stops_peers(text_kernel):
    """A rank that raises gives the original type, the rank and its remote traceback; the peers are stopped at once."""
    text_kernel.execute(
        """
class TrainingDiverged(Exception):
    pass
@distributed(2)
def fails():
    import os, time
    if os.environ["RANK"] == "1":
        print("about to fail", flush=True)
        raise TrainingDiverged("loss is nan")
    time.sleep(3600)  # only the stop ends rank 0 (how soon: bench/faults.py)
try:
    fails.distributed()
except TrainingDiverged as e:
    caught = e
"""
    ).check()
    out = text_kernel.execute(
        "print(type(caught).__name__, caught.__notes__, type(caught.__cause__).__name__, caught.__cause__)"
    ).check()
    assert out.stdout.startswith("TrainingDiverged ")
    assert "rank 1 of 2" in out.stdout
    assert "RemoteTraceback" in out.stdout and "loss is nan" in out.stdout
    err = text_kernel.execute("fails.distributed()")
    assert err.ename == "TrainingDiverged"
    assert "rank 1 of 2" in err.traceback and "raise TrainingDiverged" in err.traceback


@pytest.mark.parametrize(
    "body, expect",
    [
        ("os._exit(3)", "exited with code 3"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "signal 9 (SIGKILL)"),
        ("import ctypes; ctypes.string_at(0)", "signal 11 (SIGSEGV)"),
    ],
)
def test_rank_that_dies_without_exception_is_named_with_code_and_output(text_kernel, body, expect):
    """os._exit, SIGKILL and a segfault name the rank, the exit code or signal, and the tail of its output."""
    text_kernel.execute(
        f"""
@distributed(2)
def dies():
    import os, signal, time
    if os.environ["RANK"] == "0":
        print("last words of rank 0", flush=True)
        {body}
    time.sleep(120)
"""
    ).check()
    err = text_kernel.execute("dies.distributed()")
    assert err.ename == "WorkerDiedError", err.traceback
    assert "rank 0" in err.traceback and expect in err.traceback
    assert "last words of rank 0" in err.traceback


def test_timeout_stops_workers_and_their_children(text_kernel, workdir):
    """On expiry every worker, a subprocess it spawned and its DataLoader workers are stopped; a TimeoutError says how
    to change the limit."""
    text_kernel.execute(
        """
@distributed(2, timeout=6)
def hangs():
    import os, subprocess, time, torch
    from torch.utils.data import DataLoader
    subprocess.Popen(["sleep", "300"])
    subprocess.Popen(["sleep", "301"], start_new_session=True)
    class Slow(torch.utils.data.Dataset):
        def __len__(self): return 10**6
        def __getitem__(self, i):
            time.sleep(1)
            return i
    for batch in DataLoader(Slow(), num_workers=2):
        print("batch", flush=True)
"""
    ).check()
    err = text_kernel.execute("hangs.distributed()", timeout=60)  # how long the stop takes: bench/faults.py
    assert err.ename == "DistributedTimeoutError"
    assert "timeout of 6 s" in err.traceback and "timeout=" in err.traceback
    assert (
        text_kernel.execute(
            "isinstance(_ if False else None, type(None)); "
            "issubclass(__import__('air_magic.errors').errors.DistributedTimeoutError, TimeoutError)"
        ).result
        == "True"
    )


def test_interrupt_stops_workers_and_next_call_works(text_kernel):
    """A kernel interrupt during a call stops every worker and raises KeyboardInterrupt; the next call runs."""
    text_kernel.execute(
        "@distributed(2, timeout=None)\ndef sleeper():\n    import time\n    print('sleeping', flush=True)\n"
        "    time.sleep(300)"
    ).check()
    msg = text_kernel.send("sleeper.distributed()")
    out = text_kernel.collect(msg, timeout=60, interrupt_when=lambda o: o.stdout.count("] sleeping") == 2)
    assert out.ename == "KeyboardInterrupt"
    left = leftover_processes(set(), wait=5, kind="job")
    assert left == [], [(p.pid, p.ppid(), p.cmdline()) for p in left]
    assert text_kernel.execute("rank.distributed()").check().result == "[0, 1]"


def test_errors_before_anything_starts(text_kernel):
    """Unpicklable arguments and globals, impossible accelerator settings and bad timeouts fail with the culprit
    named."""
    text_kernel.execute("import threading\nlock = threading.Lock()").check()
    err = text_kernel.execute("@distributed(2)\ndef uses_lock():\n    return lock.locked()\nuses_lock.distributed()")
    assert err.ename == "SerializationError" and "global 'lock'" in err.traceback
    err = text_kernel.execute("@distributed(2)\ndef takes(x):\n    return 1\ntakes.distributed(x=threading.Lock())")
    assert err.ename == "SerializationError" and "argument 'x'" in err.traceback
    err = text_kernel.execute("distributed(accelerator_type='GPU_2xH100')")
    assert err.ename == "ConfigurationError" and "none were detected" in err.traceback
    for bad in ["True", "0", "-5", "'soon'"]:
        err = text_kernel.execute(f"distributed(2, timeout={bad})")
        assert err.ename == "ConfigurationError" and "timeout" in err.traceback, bad
    for bad in ["0", "-1", "1.5", "True"]:
        err = text_kernel.execute(f"distributed(num_accelerators={bad})")
        assert err.ename == "ConfigurationError" and "num_accelerators" in err.traceback, bad


def test_decorated_object_api(text_kernel):
    """.func runs locally, a direct call explains what to call, with_overrides copies, old names warn."""
    text_kernel.execute("@distributed(2)\ndef add(a, b):\n    return a + b").check()
    assert text_kernel.execute("add.func(1, 2)").check().result == "3"
    err = text_kernel.execute("add(1, 2)")
    assert err.ename == "TypeError" and "add.distributed(...)" in err.traceback and "add.func(...)" in err.traceback
    assert text_kernel.execute("add.with_overrides(num_accelerators=3).distributed(1, 1)").check().result == "[2, 2, 2]"
    assert text_kernel.execute("add.settings.num_accelerators").check().result == "2"
    out = text_kernel.execute(
        "import warnings\nwith warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n"
        "    old = distributed(gpus=2)\nprint(w[0].category.__name__, w[0].message)"
    ).check()
    assert "FutureWarning" in out.stdout and "num_accelerators" in out.stdout
    err = text_kernel.execute("distributed(num_accelerators=2, gpus=2)")
    assert err.ename == "ConfigurationError"


def test_killed_kernel_leaves_no_worker(workdir, new_kernel):
    """SIGKILL of the kernel mid-run ends the supervisor, every worker and their children."""
    before = {p.pid for p in psutil.process_iter()}
    k = new_kernel(env={"AIR_MAGIC_RUNS_DIR": str(workdir / "runs")})
    k.execute(SETUP).check()
    k.execute(
        "@distributed(2, timeout=None)\ndef forever():\n    import subprocess, time\n"
        "    subprocess.Popen(['sleep', '300'])\n    print('up', flush=True)\n    time.sleep(300)"
    ).check()
    k.send("forever.distributed()")

    def both_up() -> bool:
        logs = list((workdir / "runs").glob("*forever*/rank-*.log"))
        return len(logs) >= 2 and all("up" in p.read_text() for p in logs)

    wait_until(both_up, 60, "the two ranks never said they were up", step=0.2)
    tree = psutil.Process(k.pid).children(recursive=True)
    assert len(tree) >= 5, tree  # supervisor, 2 workers, 2 sleeps (and the store)
    os.kill(k.pid, signal.SIGKILL)
    k.km.provisioner.process.wait()
    assert leftover_processes(before, wait=10) == []


def _visible_devices():
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.usefixtures("here_runs")
def test_cpu_workers_see_no_gpu_unless_told_to():
    """Ranks of a CPU call get CUDA_VISIBLE_DEVICES empty (so code picking nccl by torch.cuda.is_available() picks
    gloo)."""
    assert run_here(_visible_devices).values == ["", ""]
    assert run_here(_visible_devices, env={"CUDA_VISIBLE_DEVICES": "0"}).values == ["0", "0"]
