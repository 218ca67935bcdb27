"""The watch's cost: the same DDP loop with a DataLoader and an all_reduce per step, watched and not, in one run.

python bench/watch.py [--ranks 2] [--steps 200] [--rounds 3]

Rounds alternate watch=True and watch=False (so drift in the machine hits both alike); each rank times its own
steps and the median step of the ranks' medians is kept per round. The ratio is watched / unwatched over the
rounds' medians: 1.00 means the watch costs a step nothing measurable. Also the watch's own work per step, timed
in this process without any rank: a DataLoader batch and a collective through the rank's patches, with and
without a call being watched.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from air_magic import distributed


def train(steps: int, warmup: int = 20) -> float:
    """DDP over a small MLP, batches from a DataLoader, the loss all-reduced each step: this rank's median step."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    width, depth, batch = (4096, 8, 256) if gpu else (512, 4, 64)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = DDP(nn.Sequential(*layers).to(device), device_ids=[device.index] if gpu else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(batch * 8, width))
    times: list[float] = []
    done = 0
    last = time.perf_counter()
    while done < steps:
        for (x,) in DataLoader(data, batch_size=batch):
            opt.zero_grad(set_to_none=True)
            loss = model(x.to(device)).float().pow(2).mean()
            loss.backward()
            opt.step()
            dist.all_reduce(loss.detach())
            if gpu:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if done >= warmup:
                times.append(now - last)
            last, done = now, done + 1
            if done == steps:
                break
    dist.destroy_process_group()
    return statistics.median(times)


def per_step_work(n: int = 200_000) -> dict[str, float]:
    """Microseconds the rank's patches add to one batch and one collective, watched and not (no rank started)."""
    import tempfile

    from air_magic.launch.rank import steps

    def plain(_: object = None) -> int:
        return 0

    batch, collective = steps._timed_next(plain), steps._timed_collective("all_reduce", plain)

    def timed(fn: object) -> float:
        began = time.perf_counter()
        for _ in range(n):
            fn(None)  # type: ignore[operator]
        return (time.perf_counter() - began) / n * 1e6

    out = {"plain_us": timed(plain), "batch_off_us": timed(batch), "collective_off_us": timed(collective)}
    with tempfile.TemporaryDirectory() as tmp:
        steps._recorder = steps.Recorder(Path(tmp) / "rank-0.steps.json", 0)
        try:
            out["batch_on_us"] = timed(batch)
            out["collective_on_us"] = timed(collective)
        finally:
            steps._recorder = None
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "watch.json")
    args = ap.parse_args()
    on = distributed(args.ranks, mlflow=False, watch=True)(train)
    off = on.with_overrides(watch=False)
    watched, unwatched = [], []
    for _ in range(args.rounds):
        watched.append(statistics.median(on.distributed(args.steps)))
        unwatched.append(statistics.median(off.distributed(args.steps)))
    import torch

    a, b = statistics.median(watched), statistics.median(unwatched)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": os.environ.get("BENCH_MACHINE") or f"{os.cpu_count()} CPU cores",
        "load": round(os.getloadavg()[0], 2),
        "ranks": args.ranks,
        "gpu": torch.cuda.is_available(),
        "steps": args.steps,
        "watched_step_s": watched,
        "unwatched_step_s": unwatched,
        "ratio": a / b,
        "per_step_work": per_step_work(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"{args.ranks} ranks, {'GPU' if report['gpu'] else 'CPU'}: watched {a * 1e3:.2f} ms, "
        f"unwatched {b * 1e3:.2f} ms a step, ratio {a / b:.3f}; patches: {report['per_step_work']}"
    )


if __name__ == "__main__":
    main()
