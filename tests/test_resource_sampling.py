"""The resource sampler (air_magic/resources.py) following real processes: their memory, peaks and exits."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from air_magic.job import JobResult, JobSpec, RankResult, RankState
from air_magic.listeners import RunContext
from air_magic.resources import ResourceSampler

pytestmark = pytest.mark.slow

MiB = 2**20


def spec(world: int = 2, accelerator: str = "CPU", nodes: int = 1, **env: str) -> JobSpec:
    return JobSpec(print, (), {}, "train", world, accelerator, None, mlflow=False, extra_env=env, num_nodes=nodes)


HOLDS = """
import sys, time
block = bytearray(120 * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
print("ready", flush=True)
time.sleep(60)
"""


def test_the_sampler_follows_a_real_process_and_its_children_and_logs_its_peak(tmp_path: Path):
    """A rank whose child holds 120 MiB is sampled with at least that, drops out of the latest sample when it
    ends, and the sinks get its figures and its peak."""
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {HOLDS!r}])"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        ctx = RunContext(spec(1), tmp_path, [])
        ctx.pids[0] = parent.pid
        logged: list[tuple[dict[str, float], int]] = []
        sampler = ResourceSampler(period=0.1, log_every=0.2)
        sampler.sinks.append(lambda values, step: logged.append((values, step)))
        sampler.on_start(ctx)
        deadline = time.monotonic() + 20
        while (0 not in sampler.latest() or not logged) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sampler.latest()[0].memory >= 120 * MiB
        assert logged[0][0]["system/rank_0/memory_mib"] >= 120
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
        assert parent.stdout is not None
        parent.stdout.close()
    seen = sampler.count
    while sampler.count < seen + 2:
        time.sleep(0.05)
    assert 0 not in sampler.latest() and sampler.peaks()[0].memory >= 120 * MiB
    sampler.on_end(JobResult(ctx.spec, tmp_path, [RankResult(0, RankState.DONE)]))
    assert logged[-1][0]["system/rank_0/memory_peak_mib"] >= 120


def test_a_rank_that_exits_before_the_hand_over_still_has_its_figures_sent(tmp_path: Path):
    """Rank 1 starts after the first figures went to the sinks and exits before the next hand-over: its cpu_percent
    and memory_mib still reach the sinks (with the end's batch), not only rank 0's."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        ctx = RunContext(spec(2), tmp_path, [])
        ctx.pids[0] = procs[0].pid
        logged: list[dict[str, float]] = []
        sampler = ResourceSampler(period=0.1, log_every=3600)  # the first figures at once, then only at the end
        sampler.sinks.append(lambda values, step: logged.append(values))
        sampler.on_start(ctx)
        deadline = time.monotonic() + 20
        while not logged and time.monotonic() < deadline:
            time.sleep(0.05)
        ctx.pids[1] = procs[1].pid
        while len(sampler.latest()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        procs[1].kill()
        procs[1].wait()
        seen = sampler.count
        while sampler.count < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(sampler.latest()) == {0}
        sampler.on_end(JobResult(ctx.spec, tmp_path, [RankResult(0, RankState.DONE), RankResult(1, RankState.DONE)]))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    sent = {name for values in logged for name in values}
    for rank in (0, 1):
        assert f"system/rank_{rank}/cpu_percent" in sent and f"system/rank_{rank}/memory_mib" in sent, sorted(sent)
