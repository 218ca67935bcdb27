"""The cost of measuring DDP's all-reduce wait: DDP steps measured and not, in the same ranks of the same call.

python bench/ddp_wait.py [--ranks 2] [--rounds 5] [--configs 512x4/25 512x4/0.25 2048x8/25:40]

The watch measures DDP's gradient all-reduce wait on each rank (air_magic/launch/rank/ddp_wait.py), on by default.
Each round is one watched call whose ranks train one DDP model (an MLP, batches from a DataLoader, AdamW) in blocks
of steps, measured and not in turn, ordered measured-plain, plain-measured, ... so neither always goes first:
`AIR_MAGIC_WATCH_DDP` is `1` in the ranks during the measured blocks and `0` during the others (the watch reads it
at each DDP forward). Each rank times its steps; the first block of each kind is the warm-up (DDP rebuilds its
buckets), not counted. Per round, the median step of each kind over the ranks; the ratio is measured / plain, and
the figure kept is the median of the rounds' ratios: 1.00 means the measure costs a step nothing measurable.
`--configs` runs each model and bucket size given as WIDTHxDEPTH/BUCKET_MB[:STEPS], STEPS counted steps of each
kind a call (`--steps` when left out): 512x4 is a 4 MiB model with a 20 ms step on 2 CPU ranks, in DDP's default 25 MB
buckets or in 0.25 MB ones (several buckets a step); 2048x8 a 128 MiB one in DDP's default buckets.
Also the measure's own work per step, timed in this process without any rank: a small layer's forward and backward
with it and without. `--design` names the design measured, in the result file (bench/README.md compares designs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from air_magic import distributed


def train(steps: int, block: int, width: int, depth: int, bucket_mb: float) -> dict[str, Any]:
    """One DDP model trained in blocks of `block` steps, measured and not in turn, `steps` counted steps each (after
    a warm-up block of each): this rank's median step of each, and the buckets a backward reduces."""
    import os
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from air_magic import envvars

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    batch = 256 if gpu else 64

    def model() -> Any:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        return DDP(
            nn.Sequential(*layers).to(device), device_ids=[device.index] if gpu else None, bucket_cap_mb=bucket_mb
        )

    ddp = model()
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(batch * 8, width))
    times: dict[str, list[float]] = {"measured": [], "plain": []}
    for index in range(2 * (steps // block + 1)):
        first = (index // 2) % 2 == 0  # pairs of blocks in turn measured-plain and plain-measured
        name = "measured" if (index % 2 == 0) == first else "plain"
        os.environ[envvars.WATCH_DDP] = "1" if name == "measured" else "0"
        done = 0
        last = time.perf_counter()
        while done < block:
            for (x,) in DataLoader(data, batch_size=batch):
                opt.zero_grad(set_to_none=True)
                loss = ddp(x.to(device)).float().pow(2).mean()
                loss.backward()
                opt.step()
                if gpu:
                    torch.cuda.synchronize()
                now = time.perf_counter()
                if index >= 2:  # the first two blocks are the warm-up
                    times[name].append(now - last)
                last, done = now, done + 1
                if done == block:
                    break
    logged = ddp._get_ddp_logging_data()
    sizes = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", ""))  # after DDP's first step
    dist.destroy_process_group()
    return {
        "measured_s": statistics.median(times["measured"]),
        "plain_s": statistics.median(times["plain"]),
        "buckets": len([size for size in sizes.split(",") if size.strip()]),
    }


def per_step_work(n: int = 2000, rounds: int = 7) -> dict[str, float]:
    """Microseconds the measure adds to one training step, in this process with no rank and no DDP: the forward and
    backward of a small layer with and without its look at the output, its prehook and its two final callbacks."""
    import torch

    from air_magic.launch.rank import ddp_wait

    layer, x = torch.nn.Linear(16, 16), torch.randn(4, 16)

    def timed(on: bool) -> float:
        began = time.perf_counter()
        for _ in range(n):
            out = layer(x)
            if on:
                ddp_wait.watch(layer, out)
            out.sum().backward()
        return (time.perf_counter() - began) / n * 1e6

    pairs = [(timed(True), timed(False)) for _ in range(rounds)]
    ddp_wait.take()
    on, off = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    return {"step_on_us": round(on, 2), "step_off_us": round(off, 2), "added_us": round(on - off, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", nargs="+", default=["512x4/25", "512x4/0.25", "2048x8/25:40"])
    ap.add_argument("--design", default="final callbacks")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ddp_wait.json")
    args = ap.parse_args()
    fn = distributed(args.ranks, mlflow=False, watch=True)(train)
    load = [round(os.getloadavg()[0], 2)]
    configs = []
    for config in args.configs:
        size, _, rest = config.partition("/")
        bucket, _, count = rest.partition(":")
        width, depth = (int(n) for n in size.split("x"))
        bucket_mb, steps = float(bucket), int(count or args.steps)
        block = min(args.block, max(1, steps // 4))
        rounds = []
        for _ in range(args.rounds):
            ranks = fn.distributed(steps, block, width, depth, bucket_mb)
            measured = statistics.median(r["measured_s"] for r in ranks)
            plain = statistics.median(r["plain_s"] for r in ranks)
            rounds.append({"measured_step_s": measured, "plain_step_s": plain, "ratio": measured / plain})
        configs.append(
            {
                "config": config,
                "params_mib": depth * (width * width + width) * 4 / 2**20,
                "bucket_mb": bucket_mb,
                "buckets": max(r["buckets"] for r in ranks),
                "steps": steps,
                "block": block,
                "rounds": rounds,
                "ratio": statistics.median(r["ratio"] for r in rounds),
            }
        )
        each = ", ".join(f"{r['ratio']:.3f}" for r in rounds)
        print(
            f"{config}, {configs[-1]['buckets']} bucket(s): measured "
            f"{statistics.median(r['measured_step_s'] for r in rounds) * 1e3:.2f} ms, plain "
            f"{statistics.median(r['plain_step_s'] for r in rounds) * 1e3:.2f} ms a step; ratio "
            f"{configs[-1]['ratio']:.3f} (rounds: {each})",
            flush=True,
        )
        load.append(round(os.getloadavg()[0], 2))
    import torch

    gpu = torch.cuda.is_available()
    machine = f"{torch.cuda.get_device_name(0)}, " if gpu else "CPU, "
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": os.environ.get("BENCH_MACHINE") or f"{machine}{platform.machine()}, {os.cpu_count()} cores",
        "load": load,
        "ranks": args.ranks,
        "gpu": gpu,
        "backend": "nccl" if gpu else "gloo",
        "design": args.design,
        "configs": configs,
        "per_step_work": per_step_work(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"the measure's own work: {report['per_step_work']}; wrote {args.out}")


if __name__ == "__main__":
    main()
