"""Where the time of a warm launch goes: timestamps of each phase of a trivial job, per rank.

    python bench/launch_phases.py [--ranks 2] [--repeat 3]
Prints, for each call, seconds from the call to: the function starting on each rank, CUDA ready,
process group ready, all-reduce done, group destroyed (the function returns), every rank's process
gone (as the launcher saw it), and the results back in the caller. The last two lines of each block
are what air_magic adds after the function returned: the process exit, then its own hand-back.
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
    ap.add_argument("--accelerator-type", default=None, help="CPU for gloo workers on a GPU machine; default: detected")
    args = ap.parse_args()
    for destroy in (True, False):
        f = distributed(args.ranks, accelerator_type=args.accelerator_type, mlflow=False, warm=True)(job)
        f.distributed(destroy)  # warm-up call
        rows = []
        for _ in range(args.repeat):
            t0 = time.time()
            res = f.run(destroy)
            back = time.time()
            phases = {k: max(r[k] for r in res.values) - t0 for k in res.values[0]}
            phases["ranks exited"] = max(r.exited_at or back for r in res.ranks) - t0
            phases["results back"] = back - t0
            rows.append(phases)
        print(f"destroy_process_group={destroy}: median seconds from the call, over {args.repeat} calls")
        for k in rows[0]:
            print(f"  {k:>14}: {statistics.median(r[k] for r in rows):.3f}")
        exit_s = statistics.median(r["ranks exited"] - r["destroyed"] for r in rows)
        back_s = statistics.median(r["results back"] - r["ranks exited"] for r in rows)
        print(f"  after the last return: process exit {exit_s:.3f} s, then results in the caller {back_s:.3f} s")


if __name__ == "__main__":
    main()
