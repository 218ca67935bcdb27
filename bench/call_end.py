"""How a call ends on the local launcher: from the last rank's return to the results in the caller.

In one fresh process (outside Jupyter, 2 CPU ranks, MLflow off), in the same run:

- gap: a warm call of a trivial gloo all-reduce, then --repeat more; each rank returns `time.time()` as its
  last act, and the caller takes the time the results are back; the median gap, in seconds
  (it once waited for each rank's exit, which spent 0.15 s resetting torch's operator libraries);
- stray: a rank's child that ignores SIGTERM, warm and fresh (warm=False); seconds from the last rank's
  return to the results, as a fraction of the stop grace it no longer waits for.

Prints one JSON line. Not a test: the figures depend on the machine and on what else runs on it.

    python bench/call_end.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, statistics, sys, time
import psutil
from air_magic import distributed
from air_magic.calls import runner

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
for _ in range(int(sys.argv[1])):
    res = f.run()
    gaps.append(time.time() - max(res.values))

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"

@distributed(2, accelerator_type="CPU", mlflow=False)
def leaves_a_stray(warm):
    import os, subprocess, sys, time
    pid = subprocess.Popen([sys.executable, "-c", STUBBORN]).pid if os.environ["RANK"] == "0" else None
    time.sleep(0.5)  # the stray has set its SIGTERM handler
    return pid, time.time()

stray = {}
for warm in (True, False):
    res = leaves_a_stray.with_overrides(warm=warm).run(warm)
    back = time.time() - max(t for _, t in res.values)
    stray["warm" if warm else "fresh"] = {"back s": back, "x stop grace": back / runner.STOP_GRACE}
print(json.dumps({"gap median s": statistics.median(gaps), "gaps s": sorted(gaps), "stray": stray}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="air-magic-call-end-"))
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        AIR_MAGIC_DISPLAY="text",
        AIR_MAGIC_RUNS_DIR=str(work),
        AIR_MAGIC_FORCE_CPU="1",
    )
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(args.repeat)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=work,
        check=True,
    )
    print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
