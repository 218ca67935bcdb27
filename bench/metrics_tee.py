"""Cost of the live-chart copy of each `mlflow.log_metric` call in a worker (air_magic/tracking/hook.py).

In one plain process set up as a worker of a call is (MLflow's asynchronous logging,
`MLFLOW_RUN_ID` of a run in a fresh local store, `AIR_MAGIC_INTERNAL_RUN_DIR`, `RANK`), times
(CPU time of the calling thread)
`mlflow.log_metric` without and with the copy to the rank's chart file (`RunDir.chart_metrics`), interleaved
in rounds of `--calls` calls, and the same for `mlflow.log_metrics` with 4 values; then
the copy alone (the same wrapper around functions that do nothing), which is what the
charts add to a training step whatever MLflow's own cost is.
Prints one JSON line and writes bench/results/metrics_tee.json.

    python bench/metrics_tee.py [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, os, sys, time
calls, rounds = int(sys.argv[1]), int(sys.argv[2])
import mlflow
from air_magic.tracking.listener import ASYNC_LOGGING_ENV
client = mlflow.MlflowClient()
run = client.create_run(client.create_experiment("tee-" + str(time.time()))).info.run_id
os.environ.update(ASYNC_LOGGING_ENV, MLFLOW_RUN_ID=run, AIR_MAGIC_MLFLOW_RUN_ID=run, RANK="0")
mlflow.log_metric("warm", 0.0)
plain_metric, plain_metrics = mlflow.log_metric, mlflow.log_metrics
from air_magic.tracking import hook
hook._tee_metrics(mlflow, run)
tee_metric, tee_metrics = mlflow.log_metric, mlflow.log_metrics
assert tee_metric is not plain_metric
def time_loop(fn, many):
    # CPU time of this thread: what the training loop pays, less sensitive to other processes than the wall clock
    t = time.thread_time()
    for i in range(calls):
        if many:
            fn({"a": 1.0 / (i + 1), "b": i, "c": 0.5, "d": 2.0}, step=i)
        else:
            fn("loss", 1.0 / (i + 1), step=i)
    return (time.thread_time() - t) / calls * 1e6
out = {"plain_metric_us": [], "tee_metric_us": [], "plain_metrics4_us": [], "tee_metrics4_us": []}
for _ in range(rounds):
    out["plain_metric_us"].append(time_loop(plain_metric, False))
    out["tee_metric_us"].append(time_loop(tee_metric, False))
    out["plain_metrics4_us"].append(time_loop(plain_metrics, True))
    out["tee_metrics4_us"].append(time_loop(tee_metrics, True))
# the copy alone: the same wrapper around functions that do nothing
import types
fake = types.ModuleType("fake")
fake.log_metric = lambda *a, **k: None
fake.log_metrics = lambda *a, **k: None
run_dir = os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"]
os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"] = os.path.join(run_dir, "alone")
os.mkdir(os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"], 0o700)
hook._tee_metrics(fake, run)
out["tee_alone_metric_us"] = [time_loop(fake.log_metric, False) for _ in range(rounds)]
out["tee_alone_metrics4_us"] = [time_loop(fake.log_metrics, True) for _ in range(rounds)]
os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"] = run_dir
mlflow.flush_async_logging()
from pathlib import Path
from air_magic.launch.files.rundir import RunDir
lines = sum(1 for _ in open(RunDir(Path(run_dir)).chart_metrics(0)))
out["lines_written"] = lines
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="air-magic-tee-"))
    (work / "run").mkdir(mode=0o700)
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        AIR_MAGIC_INTERNAL_RUN_DIR=str(work / "run"),
        MLFLOW_TRACKING_URI=f"sqlite:///{work}/mlflow.db",
    )
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(args.calls), str(args.rounds)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    med = {k: round(statistics.median(v), 1) for k, v in raw.items() if isinstance(v, list)}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()}-core CPU VM, Python {platform.python_version()}",
        "calls_per_round": args.calls,
        "rounds": args.rounds,
        **{f"median_{k}": v for k, v in med.items()},
        "load_average_1min": round(os.getloadavg()[0], 1),
        "lines_written": raw["lines_written"],
        "lines_expected": args.rounds * args.calls * 5,
    }
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics_tee.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
