"""How a call ends on the local launcher: results as soon as every rank is done, exits finished before the next call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_LEFTOVER_THREAD = """
import json
from air_magic import distributed

def job():
    import os, threading, time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon: an interpreter exit would wait
    return os.getpid()

f = distributed(2, accelerator_type="CPU", mlflow=False, warm=True)(job)
print(json.dumps([f.distributed() for _ in range(2)]))
"""

_STRAY = """
import json, os, sys, time
import psutil
from air_magic import distributed

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"

@distributed(2, accelerator_type="CPU", mlflow=False)
def leaves_a_stray(warm):
    import os, subprocess, sys, time
    pid = subprocess.Popen([sys.executable, "-c", STUBBORN]).pid if os.environ["RANK"] == "0" else None
    time.sleep(0.5)  # the stray has set its SIGTERM handler
    return pid, time.time()

@distributed(2, accelerator_type="CPU", mlflow=False)
def alive(pid):
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

out = {}
for warm in (True, False):
    res = leaves_a_stray.with_overrides(warm=warm).run(warm)
    (pid, _), _ = res.values
    out[str(warm)] = {"stray alive after the call": psutil.pid_exists(pid),
                      "stray alive in the next call": any(alive.distributed(pid))}
print(json.dumps(out))
"""

_SLOW_PEER = """
import json
from air_magic import distributed

def join(slow_rank):
    import os, re, time
    import torch.distributed as dist
    rank = int(os.environ["RANK"])

    class SlowAfterPublishing(dist.Store):
        # the rendezvous store, but the slow rank stalls once it has published its own address, before it reads a
        # peer's: its peers' connections to it are made while it has not yet made its own
        def __init__(self, inner):
            super().__init__()
            self.inner, self.stalled = inner, None
        def get(self, key):
            value = self.inner.get(key)
            if rank == slow_rank and self.stalled is None and re.search(r"(^|/)[0-9]+$", key):
                time.sleep(1.5)
                self.stalled = time.time()
            return value
        def set(self, key, value): return self.inner.set(key, value)
        def add(self, key, n): return self.inner.add(key, n)
        def check(self, keys): return self.inner.check(keys)
        def wait(self, keys, timeout=None):
            return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    inner = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    store = SlowAfterPublishing(inner)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    return time.time(), store.stalled

f = distributed(4, accelerator_type="CPU", mlflow=False)(join)
calls = [f.distributed(3) for _ in range(3)]
print(json.dumps([[returned - call[3][1] for returned, _ in call[:3]] for call in calls]))
"""


def _run(code: str, tmp_path: Path) -> object:
    root = Path(__file__).resolve().parents[1]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(root),
        "AIR_MAGIC_DISPLAY": "text",
        "AIR_MAGIC_RUNS_DIR": str(tmp_path),
        "AIR_MAGIC_FORCE_CPU": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_results_come_back_without_waiting_for_the_ranks_interpreter_teardown(tmp_path):
    """Ranks that leave a non-daemon thread running still end once their function returns, and the next call gets
    new ranks (a rank ends without Python's teardown; how soon the results follow: bench/call_end.py)."""
    first, second = _run(_LEFTOVER_THREAD, tmp_path)
    assert len(set(first + second)) == 4, (first, second)


@pytest.mark.slow
def test_a_stray_process_does_not_hold_the_results_but_is_gone_before_the_next_call(tmp_path):
    """A rank's child that ignores SIGTERM does not hold the results back until the stop grace kills it (it is still
    alive when they come), warm or fresh; the next call starts only once it is gone (timings: bench/call_end.py)."""
    for warm, seen in _run(_STRAY, tmp_path).items():
        assert seen["stray alive after the call"], (warm, seen)
        assert not seen["stray alive in the next call"], (warm, seen)


@pytest.mark.slow
def test_no_rank_leaves_init_process_group_before_every_peer_has_joined(tmp_path):
    """`init_process_group()` returns on a rank only once every rank has made its connections, so a function that
    returns right after it cannot end its process while a slower peer still connects to it (that peer then failed
    with gloo's "Connection closed by peer"). Rank 3 stalls 1.5 s inside its init after publishing its address; in
    each of 3 calls (gloo picks which side of each pair connects at random), ranks 0-2 return after it resumed."""
    for call in _run(_SLOW_PEER, tmp_path):
        assert all(after >= 0 for after in call), f"a rank left init before rank 3 had joined: {call}"
