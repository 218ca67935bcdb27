"""What a call costs through Ray: a trivial all-reduce on a simulated cluster against the local launcher, same run.

Starts the tests' simulated cluster (a head without CPUs and two 2-CPU
nodes, all on 127.0.0.1, see tests/ray_cluster.py), joins it with
`ray_init`, then alternates the same job (init the process group, all-reduce
one tensor, destroy the group) through the local launcher (one node, warm)
and through the Ray launcher (`num_nodes=2`), timed from the call to the
results back, MLflow off. Every Ray call places a placement group, starts
one actor per rank, imports torch in each and tears it all down again.

    python bench/ray_launch.py [--per-node 1] [--repeat 3] [--out bench/results/ray_launch.json]
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import ray_cluster  # noqa: E402  (sets Ray's loopback variable before Ray is imported)


def job() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    value = t.item()
    dist.destroy_process_group()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-node", type=int, default=1, help="ranks on each of the 2 nodes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "ray_launch.json"))
    args = parser.parse_args()
    os.environ.setdefault("AIR_MAGIC_RUNS_DIR", tempfile.mkdtemp(prefix="ray-bench-"))
    os.environ["AIR_MAGIC_DISPLAY"] = "text"
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    from air_magic import distributed, ray_init

    t0 = time.perf_counter()
    cluster = ray_cluster.start_cluster()
    cluster_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray_init(cluster.address, log_to_driver=False)
    join_s = time.perf_counter() - t0
    ranks = 2 * args.per_node
    local = distributed(ranks, accelerator_type="CPU", mlflow=False, warm=True)(job)
    on_ray = distributed(args.per_node, accelerator_type="CPU", num_nodes=2, mlflow=False)(job)
    timed: dict[str, list[float]] = {}
    try:
        for _ in range(args.repeat):
            for name, fn in ((f"local launcher, {ranks} ranks (warm)", local),
                             (f"Ray launcher, 2 nodes x {args.per_node} rank(s)", on_ray)):
                t0 = time.perf_counter()
                values = fn.distributed()
                timed.setdefault(name, []).append(time.perf_counter() - t0)
                assert values == [float(ranks)] * ranks, values
            ray_cluster.wait_all_free()
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
        from air_magic.launch.local import local_launcher

        local_launcher().shutdown()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_at_end": os.getloadavg(),
        "cluster_start_s": round(cluster_s, 2),
        "ray_init_join_s": round(join_s, 2),
        "seconds": timed,
        "median_s": {k: round(statistics.median(v), 3) for k, v in timed.items()},
        "first_s": {k: round(v[0], 3) for k, v in timed.items()},
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["median_s"], indent=2), "first:", report["first_s"])


if __name__ == "__main__":
    main()
