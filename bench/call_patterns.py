"""The ways users call, in one run: Run All, a pause after loading, sweeps of warm and of hot calls that log to MLflow.

Every pattern runs the same job (an all-reduce on every rank: gloo on CPU, NCCL on GPUs; the logging
variant adds `import mlflow; mlflow.log_metric(...)`) in a fresh process per pattern, an IPython shell
(the notebook process, without Jupyter) with MLflow's default local store in a fresh directory:

- Run All: `%load_ext air_magic`, then the first (logging) call at once.
- pause: `%load_ext air_magic`, 5 s, the first call; then warm calls (their median is "warm").
- sweep: `%load_ext air_magic`, then 5 logging calls back to back, then 5 bare calls: calls 2-5 of each.
- hot: the same with `keep_alive=60`.
- fresh processes: `warm=False`, the first call right after loading, then two more.
- torchrun: `torchrun --nproc-per-node N` of the same logging job from the shell, logging to one run.

Reported: medians, and the figures the project holds itself to: the first call of Run All against a
fresh-process first call (+0.3 s at most); the paused first call against 1.5 x warm + 0.3 s on CPU
(2 x on GPUs); each sweep and hot call that logs against a bare one (+0.3 s at most). Every logging
call's run is checked to hold one metric per rank.

    python bench/call_patterns.py [--ranks 2] [--cpu] [--out bench/results/call_patterns-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One pattern in its own process: prints one JSON line of timings.
PROBE = r"""
import contextlib, io, json, os, statistics, sys, time
sys.path.insert(0, sys.argv[1])
pattern, ranks, kind = sys.argv[2], int(sys.argv[3]), sys.argv[4] or None
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
t = time.perf_counter()
shell.run_line_magic("load_ext", "air_magic")
out = {"loading s": time.perf_counter() - t}
if pattern == "pause":
    time.sleep(5.0)
from air_magic import distributed

def _allreduce():
    import os
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    t = torch.ones(1, device="cuda" if gpu else "cpu")
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()

def bare_job():
    return _allreduce()

def logging_job():
    value = _allreduce()
    import os
    import mlflow
    mlflow.log_metric("x", value + int(os.environ["RANK"]))  # one value per rank: MLflow keeps equal rows once
    return value

def timed(f, **settings):
    call = distributed(ranks, accelerator_type=kind, **settings)(f)
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        assert call.distributed() == [float(ranks)] * ranks
    return time.perf_counter() - t

if pattern in ("run_all", "pause"):
    out["first s"] = timed(logging_job)
    if pattern == "pause":
        out["warm s"] = [timed(logging_job) for _ in range(5)]
elif pattern in ("sweep", "hot"):
    settings = {"keep_alive": 60} if pattern == "hot" else {}
    out["logging s"] = [timed(logging_job, **settings) for _ in range(5)]
    out["bare s"] = [timed(bare_job, **settings) for _ in range(5)]
elif pattern == "fresh":
    out["fresh s"] = [timed(logging_job, warm=False) for _ in range(3)]
import mlflow
client = mlflow.MlflowClient()
runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)
logging = [r for r in runs if r.info.run_name == "logging_job"]
out["logging runs"] = len(logging)
out["logging runs with every rank's metric"] = sum(
    1 for r in logging if len(client.get_metric_history(r.info.run_id, "x")) == ranks
)
from air_magic.owner import owner
from air_magic.tracking import ui
owner().shutdown()
ui.shutdown()
print(json.dumps(out))
"""

# The same logging job under torchrun, logging to the run in MLFLOW_RUN_ID.
TORCHRUN_JOB = r"""
import os
import mlflow
import torch
import torch.distributed as dist

gpu = torch.cuda.is_available()
if gpu:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if gpu else "gloo")
t = torch.ones(1, device="cuda" if gpu else "cpu")
dist.all_reduce(t)
dist.destroy_process_group()
mlflow.log_metric("x", t.item())
"""


def fresh_dir() -> tuple[Path, dict[str, str]]:
    work = Path(tempfile.mkdtemp(prefix="air-magic-patterns-"))
    (work / "runs").mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AIR_MAGIC_"))}
    env.update(AIR_MAGIC_RUNS_DIR=str(work / "runs"), AIR_MAGIC_DISPLAY="text")
    return work, env


def probe(pattern: str, ranks: int, kind: str) -> dict:
    work, env = fresh_dir()
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(ROOT), pattern, str(ranks), kind],
            check=False,
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode != 0:
            sys.exit(f"{pattern} failed:\n{done.stderr[-3000:]}")
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def torchrun(ranks: int, repeat: int) -> list[float]:
    """Seconds of `torchrun --nproc-per-node ranks` of the logging job, from the shell, `repeat` times."""
    work, env = fresh_dir()
    try:
        (work / "job.py").write_text(TORCHRUN_JOB)
        uri = f"sqlite:///{work}/mlflow.db"
        setup = "import mlflow, sys; c = mlflow.MlflowClient(sys.argv[1]); print(c.create_run('0').info.run_id)"
        run_id = subprocess.run(
            [sys.executable, "-c", setup, uri], check=True, cwd=work, env=env, capture_output=True, text=True
        ).stdout.split()[-1]
        env.update(MLFLOW_TRACKING_URI=uri, MLFLOW_RUN_ID=run_id)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "job.py"]
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            subprocess.run(command, check=True, cwd=work, env=env, capture_output=True, timeout=600)
            times.append(time.perf_counter() - t)
        return times
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _gpu_count() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in done.stdout.splitlines() if line.startswith("GPU "))


def _device_name() -> str:
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    done = subprocess.run(query, check=False, capture_output=True, text=True)
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else "GPU"


def summarize(found: dict, gpu: bool) -> dict:
    """The medians and the checks the project holds itself to."""
    med = statistics.median
    fresh_first, fresh = found["fresh"]["fresh s"][0], med(found["fresh"]["fresh s"][1:])
    warm = med(found["pause"]["warm s"])
    factor = 2.0 if gpu else 1.5
    rows = {
        "Run All: first call": (found["run_all"]["first s"], "fresh-process first call", fresh_first, 0.3, "+"),
        "5 s pause: first call": (found["pause"]["first s"], "warm call", warm, factor, "x"),
    }
    for pattern in ("sweep", "hot"):
        logs, bare = med(found[pattern]["logging s"][1:]), med(found[pattern]["bare s"][1:])
        rows[f"{pattern}: calls 2-5 logging"] = (logs, f"{pattern}: calls 2-5 bare", bare, 0.3, "+")
    summary = {}
    for name, (value, against, base, k, how) in rows.items():
        bound = base + k if how == "+" else k * base + 0.3
        summary[name] = {
            "s": value,
            "against": against,
            "against s": base,
            "ratio": value / base if base else None,
            "bound s": bound,
            "within bound": value <= bound,
        }
    summary["yardsticks"] = {
        "fresh processes, calls 2-3 s": fresh,
        "torchrun (median) s": med(found["torchrun"]),
        "sweep: first call s": found["sweep"]["logging s"][0],
        "hot: first call s": found["hot"]["logging s"][0],
    }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="ranks (on a GPU node at most its GPUs)")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks even on a node with GPUs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gpus = 0 if args.cpu else _gpu_count()
    ranks = min(args.ranks, gpus) if gpus else args.ranks
    kind = "" if gpus else "CPU"
    device = _device_name() if gpus else "CPU"
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": device,
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "ranks": ranks,
        "load_before": os.getloadavg()[0],
        "patterns": {},
    }
    for pattern in ("run_all", "fresh", "pause", "sweep", "hot"):
        report["patterns"][pattern] = found = probe(pattern, ranks, kind)
        print(pattern, json.dumps({k: v for k, v in found.items() if k != "loading s"}), flush=True)
    report["patterns"]["torchrun"] = torchrun(ranks, 3)
    print("torchrun", report["patterns"]["torchrun"], flush=True)
    report["summary"] = summarize(report["patterns"], bool(gpus))
    report["load_average_at_end"] = list(os.getloadavg())
    for name, row in report["summary"].items():
        print(name, json.dumps(row), flush=True)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
