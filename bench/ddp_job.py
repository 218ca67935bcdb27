"""The DDP training loop both launchers run in bench/ddp_step.py (also runnable under torchrun)."""

from __future__ import annotations

import json
import os
import statistics
import time


def train(steps: int = 60, warmup: int = 10) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

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
    x = torch.randn(batch, width, device=device)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        if gpu:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {"median_step_s": statistics.median(times), "steps": len(times), "width": width, "depth": depth}


if __name__ == "__main__":
    result = train(int(os.environ.get("BENCH_STEPS", "60")))
    if os.environ["RANK"] == "0":
        print("RESULT " + json.dumps(result), flush=True)
