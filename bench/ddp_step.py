"""DDP step time: the same training loop under air_magic and under torchrun, in the same run.

python bench/ddp_step.py [--ranks 2] [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from ddp_job import train

from air_magic import distributed


def via_torchrun(ranks: int, steps: int) -> float:
    env = dict(os.environ, BENCH_STEPS=str(steps))
    if not _gpu():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            str(ROOT / "bench" / "ddp_job.py"),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[7:])["median_step_s"]


def _gpu() -> bool:
    import air_magic.accelerators as acc

    return acc.detect().gpu_count > 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ddp_step.json")
    args = ap.parse_args()
    job = distributed(args.ranks, mlflow=False)(train)
    ours, theirs = [], []
    for _ in range(args.rounds):  # interleaved, so drift in the machine hits both alike
        ours.append(job.distributed(args.steps)[0]["median_step_s"])
        theirs.append(via_torchrun(args.ranks, args.steps))
    a, t = statistics.median(ours), statistics.median(theirs)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "ranks": args.ranks,
        "gpu": _gpu(),
        "air_magic_step_s": ours,
        "torchrun_step_s": theirs,
        "ratio": a / t,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"DDP step, {args.ranks} ranks, {'GPU' if _gpu() else 'CPU'}: air_magic {a * 1e3:.2f} ms, "
        f"torchrun {t * 1e3:.2f} ms, ratio {a / t:.3f}"
    )


if __name__ == "__main__":
    main()
