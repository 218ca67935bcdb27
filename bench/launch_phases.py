"""Where the time of a warm launch goes: timestamps of each phase of a trivial job, per rank.

    python bench/launch_phases.py [--ranks 2] [--repeat 3]
Prints, for each call, seconds from the call to: the function starting on each rank, CUDA ready,
process group ready, all-reduce done, group destroyed, and the results back in the caller.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from air_magic import distributed  # noqa: E402


def job(destroy: bool) -> dict:
    import os
    import time

    marks = {"start": time.time()}
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.empty(1, device="cuda")
    marks["device"] = time.time()
    dist.init_process_group("nccl" if gpu else "gloo")
    marks["init"] = time.time()
    t = torch.ones(1, device="cuda" if gpu else "cpu")
    dist.all_reduce(t)
    t.item()
    marks["allreduce"] = time.time()
    if destroy:
        dist.destroy_process_group()
    marks["destroyed"] = time.time()
    return marks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for destroy in (True, False):
        f = distributed(args.ranks, mlflow=False, warm=True)(job)
        f.distributed(destroy)  # warm-up call
        rows = []
        for _ in range(args.repeat):
            t0 = time.time()
            res = f.run(destroy)
            back = time.time()
            phases = {k: max(r[k] for r in res.values) - t0 for k in res.values[0]}
            phases["results back"] = back - t0
            rows.append(phases)
        print(f"destroy_process_group={destroy}: median seconds from the call, over {args.repeat} calls")
        for k in rows[0]:
            print(f"  {k:>14}: {statistics.median(r[k] for r in rows):.3f}")


if __name__ == "__main__":
    main()
