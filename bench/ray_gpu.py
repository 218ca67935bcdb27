"""The Ray launcher on a GPU node: the same seeded DDP training through Ray and through the local launcher.

On a node with NVIDIA GPUs, `ray_init()` starts Ray here (on 127.0.0.1);
then a DDP training (NCCL, `torch.cuda.set_device(LOCAL_RANK)`, seeded)
runs on every GPU of the node once through the local launcher and once
through the Ray launcher, one actor per rank. With one GPU the Ray call is
given the Ray launcher explicitly (`num_nodes=1` never uses Ray on its own);
with two or more the Ray call is `num_nodes=2` over 2 simulated nodes of the
same machine, each holding half of the GPUs. Prints both calls' losses, which
must be equal, each rank's node id and CUDA_VISIBLE_DEVICES, the call times,
cold and then hot (`keep_alive`: three calls, the last two in the first
one's actors and process group), and checks that after `release_hot()` Ray
reports every GPU free and NVML shows the GPU memory in use back where it
was before.

    python bench/ray_gpu.py [--out bench/results/ray_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import ray_cluster


def train(steps: int = 20) -> dict:
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1)).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1 + dist.get_rank())
    x, y = torch.randn(128, 256, device="cuda"), torch.randn(128, 1, device="cuda")
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 6))
    dist.destroy_process_group()
    ray = sys.modules.get("ray")  # imported in a Ray actor; the local launcher's ranks have no Ray
    node = ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None
    return {
        "losses": losses,
        "node": node,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": torch.cuda.get_device_name(),
        "rank": int(os.environ["RANK"]),
        "pid": os.getpid(),
    }


def gpu_memory_used_mib() -> list[int]:
    """Memory in use on each GPU, as NVML reports it."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return [
            int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used) >> 20
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
    finally:
        pynvml.nvmlShutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ray_gpu.json")
    args = ap.parse_args()
    import torch

    from air_magic import distributed, ray_init
    from air_magic.decorator import Settings
    from air_magic.owner import owner

    gpus = torch.cuda.device_count()
    if gpus < 1:
        sys.exit("needs an NVIDIA GPU")
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpus": gpus, "GPU MiB used before": gpu_memory_used_mib()}
    t = time.perf_counter()
    local = distributed(gpus, mlflow=False)(train).distributed()
    report["local s"] = time.perf_counter() - t
    if gpus >= 2:
        cluster = ray_cluster.start_cluster(nodes=0)
        for _ in range(2):
            cluster.add_node(num_cpus=2, num_gpus=gpus // 2, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes(timeout=90)
        ray_init(cluster.address)
        report["how"] = f"num_nodes=2 over 2 simulated nodes of {gpus // 2} GPU(s) each"
        call = lambda **kw: distributed(gpus // 2, num_nodes=2, mlflow=False, **kw)(train).distributed()
    else:
        ray_init()
        report["how"] = "1 node of 1 GPU, the Ray launcher given explicitly"

        def call(**kw):
            spec = Settings(num_accelerators=1, mlflow=False, **kw).spec(train, (), {}, "train")
            return owner().submit(spec).raise_for_status().values

    import ray

    for attempt in ("first", "second"):
        t = time.perf_counter()
        through_ray = call()
        report[f"ray {attempt} call s"] = time.perf_counter() - t
    hot_pids = []
    for attempt in ("first (makes the hot ranks)", "second (hot)", "third (hot)"):
        t = time.perf_counter()
        hot = call(keep_alive=600)
        report[f"ray keep_alive {attempt} call s"] = time.perf_counter() - t
        hot_pids.append([r["pid"] for r in hot])
        assert [r["losses"] for r in hot] == [r["losses"] for r in local], "a hot call trained differently"
    report["hot calls in the same processes"] = all(pids == hot_pids[0] for pids in hot_pids)
    owner().launchers.ray.release_hot()
    report["ranks"] = [{k: r[k] for k in ("rank", "node", "cuda_visible_devices", "device")} for r in through_ray]
    report["same losses"] = [r["losses"] for r in through_ray] == [r["losses"] for r in local]
    report["loss first -> last"] = [through_ray[0]["losses"][0], through_ray[0]["losses"][-1]]
    deadline = time.monotonic() + 30
    while (
        ray.available_resources().get("GPU", 0) != ray.cluster_resources().get("GPU", 0) and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    report["ray GPUs free after / total"] = [
        ray.available_resources().get("GPU", 0),
        ray.cluster_resources().get("GPU", 0),
    ]
    time.sleep(1)
    report["GPU MiB used after"] = gpu_memory_used_mib()
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    ok = (
        report["same losses"]
        and report["hot calls in the same processes"]
        and report["ray GPUs free after / total"][0] == gpus
        and report["GPU MiB used after"] == report["GPU MiB used before"]
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
