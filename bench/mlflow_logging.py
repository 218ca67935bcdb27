"""Cost of `mlflow.log_metric` inside a distributed call, and a count that every metric arrived.

Runs one call of `--ranks` CPU workers, each logging `loss` at every one of
`--steps` steps to MLflow's default local store (a fresh working directory
with no tracking URI: `sqlite:///mlflow.db`), timing each `log_metric` call
inside the worker, then (--client-steps) the same kind of step through MLflow's own
`MlflowClient.log_metric` (synchronous) to the same run. Then counts the metrics in the store, checks every rank's
log for "database is locked", and prints one JSON line (also written to
bench/results/mlflow_logging-<ranks>x<steps>.json). For comparison it also times the same
loop in one plain process, with MLflow's default synchronous logging and with
the environment air_magic gives workers, in a tight loop (no busy work between
calls).

    python bench/mlflow_logging.py                 # 8 ranks x 2000 steps
    python bench/mlflow_logging.py --ranks 2 --steps 500
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# One plain process, a tight loop of log_metric calls: MLflow's default (synchronous) logging when
# argv[2] is "sync", else the environment air_magic gives workers (asynchronous, batched).
PROBE = r"""
import json, os, sys, time
mode = sys.argv[2]
if mode != "sync":
    os.environ.update(json.loads(mode))
import mlflow
client = mlflow.MlflowClient()
run = client.create_run(client.create_experiment("probe-" + str(time.time())))
os.environ["MLFLOW_RUN_ID"] = run.info.run_id
mlflow.log_metric("warm", 0.0)
steps = int(sys.argv[1])
t, c = time.perf_counter(), time.thread_time()
for i in range(steps):
    mlflow.log_metric("loss", 1.0 / (i + 1), step=i)
wall, cpu = time.perf_counter() - t, time.thread_time() - c
mlflow.flush_async_logging()
print(json.dumps({"wall_us": wall / steps * 1e6, "cpu_us": cpu / steps * 1e6}))
"""


def step_loop(steps: int, step_seconds: float, client_steps: int = 0) -> dict[str, float]:
    """One rank: `steps` steps of `step_seconds` busy work, each followed by mlflow.log_metric('loss').

    Times each call by the wall clock and by the calling thread's CPU time (what the training
    loop itself pays; with more ranks than cores the wall clock also counts time slices lost to
    other ranks). The first call, which attaches the process to the run, is reported on its own.
    """
    import os
    import time

    import mlflow

    rank = int(os.environ["RANK"])
    wall = cpu = first = 0.0
    for i in range(steps):
        end = time.perf_counter() + step_seconds
        while time.perf_counter() < end:
            pass
        t, c = time.perf_counter(), time.thread_time()
        mlflow.log_metric("loss", 1.0 / (i + 1) + rank, step=i)
        dt, dc = time.perf_counter() - t, time.thread_time() - c
        if i == 0:
            first = dt
        else:
            wall += dt
            cpu += dc
    n = max(1, steps - 1)
    out = {"rank": rank, "wall_us": wall / n * 1e6, "cpu_us": cpu / n * 1e6, "first_ms": first * 1e3}
    if client_steps:  # the same steps through MLflow's own client, to the same run: one synchronous write each
        client = mlflow.MlflowClient()
        run_id = mlflow.active_run().info.run_id
        wall = cpu = 0.0
        for i in range(client_steps):
            end = time.perf_counter() + step_seconds
            while time.perf_counter() < end:
                pass
            t, c = time.perf_counter(), time.thread_time()
            client.log_metric(run_id, "loss_client", 1.0 / (i + 1) + rank, step=i)
            wall += time.perf_counter() - t
            cpu += time.thread_time() - c
        out.update(client_wall_us=wall / client_steps * 1e6, client_cpu_us=cpu / client_steps * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=2.0, help="busy work per step (ms)")
    parser.add_argument(
        "--client-steps",
        type=int,
        default=200,
        help="then this many steps through MlflowClient.log_metric, in the same ranks and run",
    )
    args = parser.parse_args()

    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.pop("MLFLOW_EXPERIMENT_NAME", None)
    work = Path(tempfile.mkdtemp(prefix="air_magic-mlflow-bench-"))
    os.chdir(work)  # MLflow's default store is ./mlflow.db: a fresh one here
    os.environ["AIR_MAGIC_RUNS_DIR"] = str(work / "runs")

    import mlflow

    from air_magic import distributed
    from air_magic.tracking.ui import shutdown

    job = distributed(num_accelerators=args.ranks, accelerator_type="CPU", timeout=3600)(step_loop)
    t = time.perf_counter()
    with open(os.devnull, "w") as quiet, _redirect(quiet):
        result = job.run(args.steps, args.step_ms / 1000, args.client_steps)
    wall = time.perf_counter() - t
    shutdown()

    client = mlflow.MlflowClient(f"sqlite:///{work}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, runs
    run = runs[0]
    history = client.get_metric_history(run.info.run_id, "loss")
    logs = "".join(p.read_text(errors="replace") for p in sorted(result.run_dir.glob("rank-*.log")))
    per_rank = result.values
    from air_magic.tracking.listener import ASYNC_LOGGING_ENV

    def probe(steps: int, mode: str) -> dict[str, float]:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(steps), mode], capture_output=True, text=True, check=True, cwd=work
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    sync = probe(min(args.steps, 300), "sync")
    uri = f"sqlite:///{work}/mlflow.db"
    tight = probe(args.steps, json.dumps(dict(ASYNC_LOGGING_ENV, MLFLOW_REGISTRY_URI=uri)))
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu_count": os.cpu_count(),
        "mlflow": mlflow.__version__,
        "ranks": args.ranks,
        "steps": args.steps,
        "step_ms": args.step_ms,
        "expected_metrics": args.ranks * args.steps,
        "stored_metrics": len(history),
        "all_arrived": len(history) == args.ranks * args.steps,
        "database_locked_errors": logs.count("database is locked"),
        "failed_batches": logs.count("Failed to log run data"),
        "run_status": client.get_run(run.info.run_id).info.status,
        "call_wall_s": round(wall, 1),
        "wall_us_per_log_metric": round(sum(r["wall_us"] for r in per_rank) / len(per_rank), 1),
        "cpu_us_per_log_metric": round(sum(r["cpu_us"] for r in per_rank) / len(per_rank), 1),
        "first_call_ms_max": round(max(r["first_ms"] for r in per_rank), 1),
        "client_steps": args.client_steps,
        "client_stored_metrics": len(client.get_metric_history(run.info.run_id, "loss_client")),
        "mlflow_client_wall_us_per_log_metric": round(
            sum(r.get("client_wall_us", 0) for r in per_rank) / len(per_rank), 1
        ),
        "mlflow_client_cpu_us_per_log_metric": round(
            sum(r.get("client_cpu_us", 0) for r in per_rank) / len(per_rank), 1
        ),
        "tight_loop_one_process_wall_us": round(tight["wall_us"], 1),
        "tight_loop_one_process_cpu_us": round(tight["cpu_us"], 1),
        "default_sync_one_process_wall_us": round(sync["wall_us"], 1),
    }
    report["cpu_overhead_pct_of_step"] = round(report["cpu_us_per_log_metric"] / (args.step_ms * 10), 2)
    report["wall_overhead_pct_of_step"] = round(report["wall_us_per_log_metric"] / (args.step_ms * 10), 2)
    print(json.dumps(report))
    out = ROOT / "bench" / "results" / f"mlflow_logging-{args.ranks}x{args.steps}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if not report["all_arrived"] or report["database_locked_errors"]:
        sys.exit(1)


class _redirect:
    """Send the call's per-rank lines to `stream` (the numbers, not 16,000 log lines, are the output)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        self.saved = sys.stdout
        sys.stdout = self.stream

    def __exit__(self, *exc: object) -> None:
        sys.stdout = self.saved


if __name__ == "__main__":
    main()
