"""The cost of the CUDA allocation history (`memory_history=True`) on a DDP step: the same training, history on and
off, in the same run.

Each round runs two calls of the same function on every GPU of the node (alternately off then on, so a drift of the
machine falls on both): a GPT-2-small-shaped decoder in DDP, bf16 autocast, batch 8 x 512 tokens, `--warmup` steps
then `--steps` timed steps (CUDA synchronized at each step's end). The history keeps Python stacks of every
allocation (air_magic's own setting, launch/rank/memory.py). The figure is the ratio of the median step time with
the history to without it; air_magic turns the history on by default only where it costs 1 % or less. Needs a GPU.

    python bench/memory_history.py [--rounds 3] [--steps 60] [--warmup 10] [--out bench/results/x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpt2 import GPT2, decoder, train_step

from air_magic import distributed

SEQ, BATCH = 512, 8


def train(shape: dict, warmup: int, steps: int) -> dict:
    """Train `warmup` then `steps` steps in DDP; the timed steps' seconds and whether the history was on."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    model = torch.nn.parallel.DistributedDataParallel(decoder(shape, "cuda"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    batches = [torch.randint(0, shape["vocab"], (BATCH, SEQ + 1), generator=g).cuda() for _ in range(4)]
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        train_step(model, opt, batches[i % len(batches)], "cuda", autocast=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    recording = torch.cuda.memory._snapshot().get("device_traces") or [[]]
    return {"step_s": times, "history_events": len(recording[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if not gpus:
        sys.exit("bench/memory_history.py needs a GPU")
    os.environ.setdefault("AIR_MAGIC_RUNS_DIR", tempfile.mkdtemp(prefix="air_magic-bench-memory-"))
    os.environ.setdefault("AIR_MAGIC_DISPLAY", "text")
    medians: dict[str, list[float]] = {"off": [], "on": []}
    events = {}
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            fn = distributed(gpus, mlflow=False, memory_history=mode == "on")(train)
            values = fn.run(GPT2, args.warmup, args.steps).raise_for_status().values
            medians[mode].append(max(statistics.median(v["step_s"]) for v in values))  # the slowest rank's median
            events[mode] = values[0]["history_events"]
            print(f"{mode}: median step {medians[mode][-1] * 1e3:.2f} ms", flush=True)
    off, on = statistics.median(medians["off"]), statistics.median(medians["on"])
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(0),
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_before": os.getloadavg()[0],
        "ranks": gpus,
        "shape": {**GPT2, "seq": SEQ, "batch": BATCH},
        "steps": args.steps,
        "step_ms": {mode: [round(m * 1e3, 3) for m in ms] for mode, ms in medians.items()},
        "history_events_rank0": events,
        "ratio_on_to_off": on / off,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
