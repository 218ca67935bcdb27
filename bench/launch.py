"""Launch benchmark: air_magic (first call, fresh-process, warm, hot) vs torchrun vs accelerate's notebook_launcher.

Every method runs the same trivial job (init the process group, all-reduce one
tensor, destroy the group) on N ranks, timed from the call to the results back,
inside one real Jupyter kernel, in the same run. GPUs and nccl when the node
has them, else CPU workers and gloo. "hot" is keep_alive: the ranks of the
previous call run the job again; "hot, logs to MLflow" also logs one metric
to the call's own MLflow run (made and ended in the notebook, part of the time).

    python bench/launch.py [--ranks 2] [--repeat 5] [--out bench/results/launch.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import Kernel

JOB = """
import os, torch, torch.distributed as dist
def job():
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # notebook_launcher sets none for 1 process
    dist.init_process_group("nccl" if gpu else "gloo")
    t = torch.ones(1, device="cuda" if gpu else "cpu")
    dist.all_reduce(t)
    value = t.item()
    dist.destroy_process_group()
    return value
def job_logs():
    import mlflow
    mlflow.log_metric("x", 1.0)
    return job()
"""

SETUP = """
import json, subprocess, sys, time, statistics
from air_magic import distributed
{job}
N = {ranks}
timed = {{}}
def clock(name, fn):
    t0 = time.perf_counter(); out = fn(); dt = time.perf_counter() - t0
    timed.setdefault(name, []).append(dt)
    return out
with open({script!r}, "w") as f:
    f.write({job_src!r} + "\\nif __name__ == '__main__':\\n    job()\\n")
"""

CALLS = {
    "air_magic first call (starts helper)": "clock(NAME, lambda: distributed(N, mlflow=False)(job).distributed())",
    "air_magic warm": "clock(NAME, lambda: distributed(N, mlflow=False, warm=True)(job).distributed())",
    "air_magic fresh processes (warm=False)": (
        "clock(NAME, lambda: distributed(N, mlflow=False, warm=False)(job).distributed())"
    ),
    "air_magic hot (keep_alive)": (
        "clock(NAME, lambda: distributed(N, mlflow=False, keep_alive=600)(job).distributed())"
    ),
    "air_magic hot, logs to MLflow": "clock(NAME, lambda: distributed(N, keep_alive=600)(job_logs).distributed())",
    "torchrun": (
        "clock(NAME, lambda: subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', "
        "str(N), {script!r}], check=True, capture_output=True))"
    ),
    "accelerate notebook_launcher": (
        "from accelerate import notebook_launcher; clock(NAME, lambda: notebook_launcher(job, num_processes=N))"
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "launch.json")
    args = ap.parse_args()
    calls = dict(CALLS)
    if args.ranks == 1:
        # With one process, notebook_launcher runs the function in the notebook itself, without the
        # torchrun variables, so the job's init_process_group cannot work there: nothing to compare.
        del calls["accelerate notebook_launcher"]
    work = Path(tempfile.mkdtemp(prefix="air-magic-bench-"))
    (work / "runs").mkdir()
    script = str(work / "job.py")
    k = Kernel(
        work,
        env={
            "AIR_MAGIC_RUNS_DIR": str(work / "runs"),
            "AIR_MAGIC_DISPLAY": "text",
            "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db",
        },
    )
    try:
        k.execute(SETUP.format(job=JOB, ranks=args.ranks, script=script, job_src=JOB)).check()
        k.execute(f"NAME = {next(iter(calls))!r}\n" + calls[next(iter(calls))]).check()
        for _ in range(args.repeat):
            for name, code in list(calls.items())[1:]:
                k.execute(f"NAME = {name!r}\n" + code.format(script=script), timeout=300).check()
        raw = json.loads(k.execute("print(json.dumps(timed))").check().stdout.strip().splitlines()[-1])
        machine = (
            k.execute("import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
            .check()
            .stdout.strip()
        )
    finally:
        k.shutdown()
    med = {name: statistics.median(ts) for name, ts in raw.items()}
    warm = med["air_magic warm"]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "ranks": args.ranks,
        "device": machine,
        "host": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "repeat": args.repeat,
        "seconds": raw,
        "median": med,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{args.ranks} ranks on {machine} ({report['host']}), median of {args.repeat} (first call: 1 run)")
    print("| method | median s | x air_magic warm |\n|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m:.3f} | {m / warm:.1f} |")


if __name__ == "__main__":
    main()
