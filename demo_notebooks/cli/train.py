"""A small DDP loop that runs unchanged under `air-magic run`, torchrun, or as a function workload (`train:main`).

The ranks' variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are set by whoever starts it; MLflow's run is the
one `air-magic run` made (MLFLOW_RUN_ID), so `mlflow.log_metric` logs into it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def main(steps: int = 20) -> float:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.tensor(0.0)
    for step in range(steps):
        x = torch.randn(32, 16, device=device)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
            if os.environ.get("MLFLOW_RUN_ID"):
                import mlflow

                mlflow.log_metric("loss", loss.item(), step=step)
    dist.destroy_process_group()
    return float(loss.item())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
