"""What MLflow costs a warm call: a bare call vs a call whose ranks `import mlflow` and log one metric.

For 1 and 2 ranks (CPU workers; GPUs when the node has them), in one fresh process per
variant (the default helper, and one started with AIR_MAGIC_PRELOAD=torch,mlflow), each
outside Jupyter (text display) against MLflow's default local store in a fresh directory:

- no MLflow: `return 1` with mlflow=False
- bare: `return 1`, tracking on (the call makes its run in the notebook process)
- logs: `import mlflow; mlflow.log_metric("x", 1.0); return 1`, tracking on

Calls alternate, after a first call that starts the helper and one call of each kind that
lets it warm up; medians of --repeat. Every metric is counted in the store afterwards.

    python bench/mlflow_launch.py [--repeat 5] [--ranks 1 2] [--out bench/results/mlflow_launch.json]
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

# One variant, in its own process: prints one JSON line of timings.
PROBE = r'''
import contextlib, io, json, os, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from air_magic import distributed
ranks, repeat, kind = json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def bare():
    return 1

def logs():
    import mlflow
    mlflow.log_metric("x", 1.0)
    return 1

def timed(f, n, on):
    call = distributed(n, accelerator_type=kind or None, mlflow=on, warm=True)(f)
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        call.distributed()
    return time.perf_counter() - t

out = {"first call (starts the helper)": timed(bare, ranks[0], True)}
out["second call (waits for the helper's warm-up)"] = timed(logs, ranks[0], True)
for n in ranks:
    rows = {"no MLflow": [], "bare": [], "logs": []}
    for name, f, on in (("bare", bare, True), ("logs", logs, True)):
        timed(f, n, on)
    for _ in range(repeat):
        for name, f, on in (("no MLflow", bare, False), ("bare", bare, True), ("logs", logs, True)):
            rows[name].append(timed(f, n, on))
    out[str(n)] = rows
import mlflow
client = mlflow.MlflowClient()
runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=10000)
out["logging runs"] = sum(1 for r in runs if r.info.run_name == "logs")
out["logging runs with every rank's metric"] = sum(
    1 for r in runs if r.info.run_name == "logs" and len(client.get_metric_history(r.info.run_id, "x")) == int(r.data.params["world_size"])
)
from air_magic.tracking import ui as mlflow_ui
mlflow_ui.shutdown()
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gpus = _gpu_count()
    kind = "GPU" if gpus else "CPU"
    ranks = [n for n in args.ranks if not gpus or n <= gpus]
    device = _device_name() if gpus else "CPU"
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "repeat": args.repeat, "load_before": os.getloadavg()[0], "variants": {},
    }
    for variant, preload in (("default helper", None), ("AIR_MAGIC_PRELOAD=torch,mlflow", "torch,mlflow")):
        work = Path(tempfile.mkdtemp(prefix="air-magic-mlflow-launch-"))
        (work / "runs").mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update(AIR_MAGIC_RUNS_DIR=str(work / "runs"), AIR_MAGIC_DISPLAY="text")
        if preload:
            env["AIR_MAGIC_PRELOAD"] = preload
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(ROOT), json.dumps(ranks), str(args.repeat), "CPU" if kind == "CPU" else ""],
            check=False, cwd=work, env=env, capture_output=True, text=True, timeout=3600,
        )
        if done.returncode != 0:
            sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
        report["variants"][variant] = json.loads(done.stdout.strip().splitlines()[-1])
    report["load_after"] = os.getloadavg()[0]
    print(f"{device} ({report['host']}), warm calls, median of {args.repeat}; load average {report['load_before']:.1f} -> {report['load_after']:.1f}")
    print("| helper | ranks | no MLflow s | bare s | logs one metric s | logs - bare | logs - no MLflow | logs / bare |")
    print("|---|---|---|---|---|---|---|---|")
    for variant, data in report["variants"].items():
        for n in ranks:
            med = {k: statistics.median(v) for k, v in data[str(n)].items()}
            data[str(n) + " median"] = med
            print(f"| {variant} | {n} | {med['no MLflow']:.3f} | {med['bare']:.3f} | {med['logs']:.3f} | "
                  f"{med['logs'] - med['bare']:+.3f} | {med['logs'] - med['no MLflow']:+.3f} | {med['logs'] / med['bare']:.1f} |")
    for variant, data in report["variants"].items():
        print(f"{variant}: first call {data['first call (starts the helper)']:.2f} s, next call "
              f"{data['second call (waits for the helper' + chr(39) + 's warm-up)']:.2f} s; logging runs with every "
              f"rank's metric: {data['logging runs with every rank' + chr(39) + 's metric']}/{data['logging runs']}")
    out = args.out or ROOT / "bench" / "results" / f"mlflow_launch-{'cpu' if kind == 'CPU' else f'{gpus}x' + device.split()[-1]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


def _gpu_count() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def _device_name() -> str:
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=False, capture_output=True, text=True)
    return done.stdout.splitlines()[0].strip()


if __name__ == "__main__":
    main()
