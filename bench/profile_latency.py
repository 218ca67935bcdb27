"""Profile latency: from the end of the last profiled step of every rank to the `Profile` in the caller, GPT-2 small.

A GPT-2-small-shaped decoder (12 layers, d_model 768, 12 heads, vocab 50257; torch only, no download) in DDP is
trained on every rank with `profile=5`; the function records when each step ended and returns right after the last
profiled step (the window warms up on step 1 and counts steps 2 to 6). The figure is the time from the
latest rank's end of that step to the call's `JobResult.profile` in this process: the ranks' trace export, the
call's end, then the analysis and the merged trace. The size of each trace is printed. On GPUs with nccl, bf16
autocast, batch 8 x 512 tokens; without GPUs, gloo on CPU ranks, batch `--batch` x `--seq` tokens (the same number
of operators per step, much less arithmetic).

    python bench/profile_latency.py [--ranks 2] [--repeat 3] [--seq 128] [--batch 2] [--out bench/results/x.json]
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

#: `air_magic.step()` calls: step k lies between the k-th and the (k+1)-th (from 0), step 0 is left out, the window
#: warms up on step 1 and counts steps 2 to 6, which the eighth call closes.
STEPS, PROFILED = 8, 5


def train(shape: dict, seq: int, batch: int) -> list[float]:
    """Build the decoder in DDP and train STEPS steps; when each step ended (time.time())."""
    import torch
    import torch.distributed as dist

    import air_magic

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    device = "cuda" if gpu else "cpu"
    model = decoder(shape, device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    ended = []
    for _ in range(STEPS):
        tokens = torch.randint(0, shape["vocab"], (batch, seq + 1), generator=g).to(device)
        train_step(ddp, opt, tokens, device, autocast=gpu)
        if gpu:
            torch.cuda.synchronize()
        air_magic.step()
        ended.append(time.time())
    return ended


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence on CPU ranks (512 on GPUs)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step on CPU ranks (8 on GPUs)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    ranks = min(args.ranks, gpus) if gpus else args.ranks
    seq, batch = (512, 8) if gpus else (args.seq, args.batch)
    os.environ.setdefault("AIR_MAGIC_RUNS_DIR", tempfile.mkdtemp(prefix="air_magic-bench-profile-"))
    os.environ.setdefault("AIR_MAGIC_DISPLAY", "text")
    fn = distributed(ranks, accelerator_type="GPU" if gpus else "CPU", mlflow=False, profile=PROFILED)(train)
    rounds = []
    for _ in range(args.repeat):
        result = fn.run(GPT2, seq, batch).raise_for_status()
        done = time.time()
        profile = result.profile
        assert profile is not None, "no profile"
        assert profile.steps == PROFILED, profile.table()
        last = profile.first_step + profile.steps - 1
        step_end = max(ended[last + 1] for ended in result.values)  # the step() call that closed it
        rounds.append(
            {
                "latency_s": done - step_end,
                "first_step": profile.first_step,
                "steps": profile.steps,
                "trace_bytes": {str(p.name): p.stat().st_size for p in profile.traces},
                "merged_bytes": profile.trace.stat().st_size if profile.trace is not None else None,
                "step_s": statistics.median(r["step"] for r in profile.ranks),
            }
        )
        print(json.dumps(rounds[-1]), flush=True)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(0) if gpus else "CPU",
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_before": os.getloadavg()[0],
        "ranks": ranks,
        "shape": {**GPT2, "seq": seq, "batch": batch},
        "rounds": rounds,
        "latency_median_s": statistics.median(r["latency_s"] for r in rounds),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
