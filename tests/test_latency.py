"""How soon a call's results come back after its last rank returns (2 CPU ranks, no kernel)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_CALLS = """
import json, statistics, sys, time
from air_magic import distributed

def job():
    import time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    return time.time()

f = distributed(2, accelerator_type="CPU", mlflow=False, warm=True)(job)
f.distributed()
gaps = []
for _ in range(7):
    res = f.run()
    gaps.append(time.time() - max(res.values))
print(json.dumps(sorted(gaps)))
"""


@pytest.mark.slow
def test_results_come_back_soon_after_the_last_rank_returns(tmp_path):
    """The median time from the last rank's return to the results in the caller, process exit included, is well
    under a tenth of a second (a rank's exit once spent 0.15 s resetting torch's operator libraries)."""
    root = Path(__file__).resolve().parents[1]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(root), "AIR_MAGIC_DISPLAY": "text",
           "AIR_MAGIC_RUNS_DIR": str(tmp_path), "AIR_MAGIC_FORCE_CPU": "1"}
    out = subprocess.run([sys.executable, "-c", _CALLS], capture_output=True, text=True, timeout=240, env=env,
                         cwd=tmp_path, check=True)
    gaps = json.loads(out.stdout.strip().splitlines()[-1])
    assert gaps[len(gaps) // 2] < 0.1, gaps
