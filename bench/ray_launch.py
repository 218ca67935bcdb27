"""What a call costs through Ray: a trivial all-reduce on a simulated cluster against the local launcher, same run.

Starts the tests' simulated cluster (a head without CPUs and two 2-CPU
nodes, all on 127.0.0.1, see tests/ray_cluster.py), joins it with
`ray_init`, then alternates the same job (init the process group, all-reduce
one tensor, destroy the group) through the local launcher (one node, warm),
the Ray launcher cold (`num_nodes=2`: a placement group and one actor per
rank, made and torn down by each call) and the Ray launcher hot
(`keep_alive`: the first call makes the actors, the next ones run in them,
which is checked by their pids), timed from the call to the results back,
MLflow off. A cold call after the first runs in the spare actors the call
before it left (launch/ray/spares.py), checked by their pids; `--pause`
seconds between rounds stand for the time a user takes between cells (a
spare set takes seconds to start and import torch; `--pause 0` measures
back-to-back calls). Then hot calls with MLflow on, as
bench/call_patterns.py does them: five that log one metric per rank, then
five bare ones, in one hot world (calls 2-5 of each compared). Then, as the
yardstick, Ray Train's `TorchTrainer.fit()` of the same job on the same
cluster (2 workers of 1 CPU, gloo).

Each round runs the local call, the hot call, then the cold call (so a
cold call's spare set is there for the next round's cold call, not taken by
the hot world's first call). `ray_init` has every node start a Ray worker for the notebook in the
background; the calls begin once that is done (as in a notebook where
`ray_init` is a cell of its own), and its time is reported as
`ray_init_warm_up_s`; `--no-wait-warm-up` calls at once instead.

    python bench/ray_launch.py [--repeat 5] [--pause 10] [--trainer-repeat 2] [--out bench/results/ray_launch.json]
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

import ray_cluster


def job() -> tuple[float, int]:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    value = t.item()
    dist.destroy_process_group()
    return value, os.getpid()


def logging_job() -> tuple[float, int]:
    import os

    import mlflow

    value, pid = job()
    mlflow.log_metric("x", value + int(os.environ["RANK"]))  # one value per rank: MLflow keeps equal rows once
    return value, pid


def trainer_loop() -> None:
    """The same job in a Ray Train worker (Ray Train made the process group)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


def fit_trainer(workers: int, storage: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    t0 = time.perf_counter()
    TorchTrainer(
        trainer_loop,
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage),
    ).fit()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-node", type=int, default=1, help="ranks on each of the 2 nodes")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pause", type=float, default=10.0, help="seconds between rounds (a user between cells)")
    parser.add_argument("--no-wait-warm-up", action="store_true", help="the first call right after ray_init")
    parser.add_argument("--trainer-repeat", type=int, default=2, help="TorchTrainer fits after the air_magic calls")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "ray_launch.json"))
    args = parser.parse_args()
    os.environ.setdefault("AIR_MAGIC_RUNS_DIR", tempfile.mkdtemp(prefix="ray-bench-"))
    os.environ["AIR_MAGIC_DISPLAY"] = "text"
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tempfile.mkdtemp(prefix='ray-bench-mlflow-')}/mlflow.db"
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    from air_magic import distributed, ray_init

    t0 = time.perf_counter()
    cluster = ray_cluster.start_cluster()
    cluster_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray_init(cluster.address, log_to_driver=False)
    join_s = time.perf_counter() - t0
    from air_magic.launch.ray.cluster import warming as warm_up_thread

    warming = warm_up_thread()
    if warming is not None and not args.no_wait_warm_up:
        warming.join()
    warm_up_s = time.perf_counter() - t0
    ranks = 2 * args.per_node
    local = distributed(ranks, accelerator_type="CPU", mlflow=False, warm=True)(job)
    on_ray = distributed(args.per_node, accelerator_type="CPU", num_nodes=2, mlflow=False)(job)
    hot = distributed(args.per_node, accelerator_type="CPU", num_nodes=2, mlflow=False, keep_alive=600)(job)
    names = {
        "local": f"local launcher, {ranks} ranks (warm)",
        "cold": f"Ray launcher, 2 nodes x {args.per_node} rank(s), cold",
        "hot": f"Ray launcher, 2 nodes x {args.per_node} rank(s), keep_alive (first call cold, then hot)",
        "trainer": f"Ray Train TorchTrainer.fit, {ranks} workers",
    }
    hot_log = distributed(args.per_node, accelerator_type="CPU", num_nodes=2, keep_alive=600)(logging_job)
    hot_bare = distributed(args.per_node, accelerator_type="CPU", num_nodes=2, keep_alive=600)(job)
    names["hot_log"] = f"Ray launcher, 2 nodes x {args.per_node} rank(s), hot, MLflow on, logs one metric"
    names["hot_bare"] = f"Ray launcher, 2 nodes x {args.per_node} rank(s), hot, MLflow on, bare"
    timed: dict[str, list[float]] = {}
    hot_pids: list[list[int]] = []
    in_spares: list[bool] = []
    import ray
    from ray._private.state import actors as actor_table

    from air_magic.launch.ray._compat import actor_id
    from air_magic.owner import owner

    def spare_ids() -> list[str]:
        """The actor ids of the spare sets kept now (asking nothing of the actors, which may still be starting)."""
        return [actor_id(a) for w in owner().launchers.ray.spare_sets() for a in w.actors]

    def call(key: str, fn) -> list:
        t0 = time.perf_counter()
        values = fn.distributed()
        timed.setdefault(names[key], []).append(time.perf_counter() - t0)
        assert [v for v, _ in values] == [float(ranks)] * ranks, values
        return values

    try:
        for round_ in range(args.repeat):
            if round_:
                time.sleep(args.pause)
            for key, fn in (("local", local), ("hot", hot), ("cold", on_ray)):
                spares = spare_ids() if key == "cold" and round_ else []
                values = call(key, fn)
                if key == "hot":
                    hot_pids.append([pid for _, pid in values])
                if key == "cold" and round_:  # the actors' pids, from Ray's table of actors (ended ones stay in it)
                    spare_pids = sorted(actor_table(actor_id=i).get("Pid") for i in spares)
                    in_spares.append(sorted(pid for _, pid in values) == spare_pids)
        assert all(pids == hot_pids[0] for pids in hot_pids), f"the hot calls ran in other processes: {hot_pids}"
        owner().launchers.ray.release_hot()
        for key, fn in (("hot_log", hot_log), ("hot_bare", hot_bare)):
            for _ in range(5):
                call(key, fn)
        import mlflow

        client = mlflow.MlflowClient()
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)
        logged = [r for r in runs if r.info.run_name == "logging_job"]
        complete = sum(1 for r in logged if len(client.get_metric_history(r.info.run_id, "x")) == ranks)
        owner().launchers.ray.release_hot()
        ray_cluster.wait_all_free()
        storage = tempfile.mkdtemp(prefix="ray-train-")
        for _ in range(args.trainer_repeat):
            timed.setdefault(names["trainer"], []).append(fit_trainer(ranks, storage))
            ray_cluster.wait_all_free(60)
    finally:
        ray.shutdown()
        cluster.shutdown()
        from air_magic.owner import owner

        owner().launchers.local.shutdown()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_at_end": os.getloadavg(),
        "cluster_start_s": round(cluster_s, 2),
        "ray_init_join_s": round(join_s, 2),
        "ray_init_warm_up_s": None if args.no_wait_warm_up else round(warm_up_s, 2),
        "seconds": timed,
        "median_s": {k: round(statistics.median(v), 3) for k, v in timed.items()},
        "first_s": {k: round(v[0], 3) for k, v in timed.items()},
        "hot_median_s_after_first": round(statistics.median(timed[names["hot"]][1:]), 3) if args.repeat > 1 else None,
        "median_after_first_s": {k: round(statistics.median(v[1:]), 3) for k, v in timed.items() if len(v) > 1},
        "hot_calls_same_pids": hot_pids,
        "pause_between_rounds_s": args.pause,
        "later_cold_calls_ran_in_spares": in_spares,
        "mlflow_logging_runs_with_every_rank_metric": f"{complete}/{len(logged)}",
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(
            {k: report[k] for k in ("median_s", "median_after_first_s", "later_cold_calls_ran_in_spares")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
