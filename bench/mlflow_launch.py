"""What MLflow costs a call: the first calls after the extension loads, and warm calls with and without MLflow.

First calls (`first`): in one fresh process per scenario, an IPython shell (the notebook
process, without Jupyter) loads the extension (`%load_ext air_magic`, or `import air_magic`),
optionally pauses, then makes a first, a second and --warm-calls more calls of a trivial gloo
all-reduce on 2 CPU ranks (1 GPU rank per GPU, up to 2, on a GPU node), MLflow on, against
MLflow's default local store in a fresh directory (so the store's first set-up is part of it).
Each scenario is checked against the bound 1.5 x warm + 0.3 s for the first and second calls.
Scenarios: %load_ext then --pause s; %load_ext then no pause; import air_magic then --pause s; %load_ext
then as long as the background work takes (this process's MLflow set-up done, the helper idle for 1 s),
which separates what a call waits for from how long a loaded machine takes to do it.

Warm costs (`warm`): for 1 and 2 ranks, in one fresh process per helper variant (the default
helper, and one started with AIR_MAGIC_PRELOAD=torch,mlflow), outside Jupyter:

- no MLflow: `return 1` with mlflow=False
- bare: `return 1`, tracking on (the call makes its run in the notebook process)
- logs: `import mlflow; mlflow.log_metric("x", 1.0); return 1`, tracking on

Calls alternate, after a first call that starts the helper and one call of each kind that
lets it warm up; medians of --repeat. Every metric is counted in the store afterwards.

    python bench/mlflow_launch.py [--parts first warm] [--pause 5] [--warm-calls 5] [--repeat 5] [--ranks 1 2]
                                  [--cpu] [--out bench/results/mlflow_launch-cpu.json]
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
PROBE = r"""
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
    1
    for r in runs
    if r.info.run_name == "logs"
    and len(client.get_metric_history(r.info.run_id, "x")) == int(r.data.params["world_size"])
)
from air_magic.tracking import ui as mlflow_ui
mlflow_ui.shutdown()
print(json.dumps(out))
"""

# One first-call scenario, in its own process: prints one JSON line of timings.
FIRST = r"""
import contextlib, io, json, os, statistics, sys, time
sys.path.insert(0, sys.argv[1])
ranks, pause, warm_calls, how, kind = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
wait_idle = sys.argv[7] == "idle"
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
t = time.perf_counter()
if how == "load_ext":
    shell.run_line_magic("load_ext", "air_magic")
else:
    shell.run_cell("import air_magic", store_history=False).raise_error()
out = {"loading s": time.perf_counter() - t}
time.sleep(pause)
if wait_idle:  # until the background work is done: this process's MLflow set-up, and the helper's imports
    import psutil
    from air_magic.owner import owner
    from air_magic.tracking import prepare
    prepare.wait()
    helper, used = psutil.Process(owner().launchers.local.supervisor_pid), -1.0
    while used != (used := sum(helper.cpu_times()[:2])):
        time.sleep(1.0)
    out["background done after s"] = time.perf_counter() - t
from air_magic import distributed

def allreduce():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

call = distributed(ranks, accelerator_type=kind or None)(allreduce)

def timed():
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        assert call.distributed() == [float(ranks)] * ranks
    return time.perf_counter() - t

out["first s"] = timed()
out["second s"] = timed()
out["warm s"] = [timed() for _ in range(warm_calls)]
warm = statistics.median(out["warm s"])
out["warm median s"] = warm
out["bound s"] = 1.5 * warm + 0.3
out["first within bound"] = out["first s"] <= out["bound s"]
out["second within bound"] = out["second s"] <= out["bound s"]
out["mlflow.db made"] = os.path.exists("mlflow.db")
from air_magic.tracking import ui
ui.shutdown()
print(json.dumps(out))
"""


def first_calls(args: argparse.Namespace, ranks: int, kind: str) -> dict:
    """Run each first-call scenario in a fresh process and working directory; their timings by scenario."""
    scenarios = {
        f"%load_ext, {args.pause:g} s pause": ("load_ext", args.pause, ""),
        "%load_ext, no pause": ("load_ext", 0.0, ""),
        f"import air_magic, {args.pause:g} s pause": ("import", args.pause, ""),
        "%load_ext, until the background work is done": ("load_ext", 0.0, "idle"),
    }
    found = {}
    for name, (how, pause, until) in scenarios.items():
        work = Path(tempfile.mkdtemp(prefix="air-magic-first-call-"))
        (work / "runs").mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update(AIR_MAGIC_RUNS_DIR=str(work / "runs"), AIR_MAGIC_DISPLAY="text")
        done = subprocess.run(
            [sys.executable, "-c", FIRST, str(ROOT), str(ranks), str(pause), str(args.warm_calls), how, kind, until],
            check=False,
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode != 0:
            sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
        found[name] = json.loads(done.stdout.strip().splitlines()[-1])
        row = found[name]
        waited = (
            f" (background done after {row['background done after s']:.1f} s)"
            if "background done after s" in row
            else ""
        )
        print(
            f"{name}: load {row['loading s']:.2f} s{waited}; first {row['first s']:.2f} s, second "
            f"{row['second s']:.2f} s, "
            f"warm {row['warm median s']:.3f} s; bound {row['bound s']:.2f} s: first "
            f"{'ok' if row['first within bound'] else 'OVER'}, second {'ok' if row['second within bound'] else 'OVER'}",
            flush=True,
        )
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=["first", "warm"], default=["first", "warm"])
    ap.add_argument("--pause", type=float, default=5.0, help="seconds between loading the extension and the first call")
    ap.add_argument("--warm-calls", type=int, default=5, help="calls after the second one (their median is 'warm')")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cpu", action="store_true", help="CPU ranks even on a node with GPUs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gpus = 0 if args.cpu else _gpu_count()
    kind = "GPU" if gpus else "CPU"
    ranks = [n for n in args.ranks if not gpus or n <= gpus]
    device = _device_name() if gpus else "CPU"
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": device,
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "repeat": args.repeat,
        "load_before": os.getloadavg()[0],
        "variants": {},
    }
    if "first" in args.parts:
        first_ranks = 2 if not gpus else min(2, gpus)
        print(f"{device}: first calls on {first_ranks} rank(s), MLflow on, fresh store", flush=True)
        report["first calls"] = {
            "ranks": first_ranks,
            "pause s": args.pause,
            "scenarios": first_calls(args, first_ranks, "CPU" if kind == "CPU" else ""),
        }
    for variant, preload in (
        ()
        if "warm" not in args.parts
        else (("default helper", None), ("AIR_MAGIC_PRELOAD=torch,mlflow", "torch,mlflow"))
    ):
        work = Path(tempfile.mkdtemp(prefix="air-magic-mlflow-launch-"))
        (work / "runs").mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update(AIR_MAGIC_RUNS_DIR=str(work / "runs"), AIR_MAGIC_DISPLAY="text")
        if preload:
            env["AIR_MAGIC_PRELOAD"] = preload
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                PROBE,
                str(ROOT),
                json.dumps(ranks),
                str(args.repeat),
                "CPU" if kind == "CPU" else "",
            ],
            check=False,
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        if done.returncode != 0:
            sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
        report["variants"][variant] = json.loads(done.stdout.strip().splitlines()[-1])
    report["load_after"] = os.getloadavg()[0]
    if report["variants"]:
        _print_warm_costs(report, args, ranks, device)
    name = "mlflow_launch" if "warm" in args.parts else "mlflow_first_calls"
    out = (
        args.out
        or ROOT / "bench" / "results" / f"{name}-{'cpu' if kind == 'CPU' else f'{gpus}x' + device.split()[-1]}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


def _print_warm_costs(report: dict, args: argparse.Namespace, ranks: list[int], device: str) -> None:
    print(
        f"{device} ({report['host']}), warm calls, median of {args.repeat}; load average {report['load_before']:.1f} "
        f"-> {report['load_after']:.1f}"
    )
    print(
        "| helper | ranks | no MLflow s | bare s | logs one metric s | logs - bare | logs - no MLflow | logs / bare |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for variant, data in report["variants"].items():
        for n in ranks:
            med = {k: statistics.median(v) for k, v in data[str(n)].items()}
            data[str(n) + " median"] = med
            print(
                f"| {variant} | {n} | {med['no MLflow']:.3f} | {med['bare']:.3f} | {med['logs']:.3f} | "
                f"{med['logs'] - med['bare']:+.3f} | {med['logs'] - med['no MLflow']:+.3f} | "
                f"{med['logs'] / med['bare']:.1f} |"
            )
    for variant, data in report["variants"].items():
        print(
            f"{variant}: first call {data['first call (starts the helper)']:.2f} s, next call "
            f"{data['second call (waits for the helper' + chr(39) + 's warm-up)']:.2f} s; logging runs with every "
            f"rank's metric: {data['logging runs with every rank' + chr(39) + 's metric']}/{data['logging runs']}"
        )


def _gpu_count() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def _device_name() -> str:
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=False, capture_output=True, text=True
    )
    return done.stdout.splitlines()[0].strip()


if __name__ == "__main__":
    main()
