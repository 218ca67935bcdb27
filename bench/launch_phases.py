"""Where the time of a launch goes: timestamps of each phase of a trivial job, per rank.

    python bench/launch_phases.py [--ranks 2] [--repeat 3]
Prints, for each call, seconds from the call to: the function starting on each rank, CUDA ready,
process group ready, all-reduce done, group destroyed (the function returns), every rank's process
gone (as the launcher saw it), and the results back in the caller. The last two lines of each block
are what air_magic adds after the function returned: the process exit, then its own hand-back.

    python bench/launch_phases.py --first-call [--ranks 2] [--pause 5]
Runs the first call of a fresh process (which starts the helper), with MLflow off, on, and on with
the ranks logging one metric, each in its own process and fresh directory (MLflow's default local
store), and prints the phases the runner reports (RunContext.phases: "creating the MLflow run",
"starting the helper", "ranks starting", "running") next to the ranks' own marks. With --pause, each
process first loads the extension as a notebook user does (`%load_ext air_magic`: the helper and MLflow's
preparation start in the background) and waits that long before the call; then what the helper's log says
of its preload and preparations.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from air_magic import distributed


def job(destroy: bool) -> dict:
    import os
    import time

    marks = {"start": time.time()}
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.empty(1, device="cuda")
    marks["device"] = time.time()
    dist.init_process_group("nccl" if gpu else "gloo")
    marks["init"] = time.time()
    t = torch.ones(1, device="cuda" if gpu else "cpu")
    dist.all_reduce(t)
    t.item()
    marks["allreduce"] = time.time()
    if destroy:
        dist.destroy_process_group()
    marks["destroyed"] = time.time()
    return marks


def job_logging(destroy: bool, log: bool) -> dict:
    """`job`, then (with `log`) `import mlflow` and one `mlflow.log_metric`, timed."""
    import time

    marks = job(destroy)
    if log:
        import mlflow

        marks["mlflow imported"] = time.time()
        mlflow.log_metric("x", 1.0)
        marks["metric logged"] = time.time()
    return marks


FIRST_CALL = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/bench")
from launch_phases import job_logging
from air_magic import distributed
from air_magic.calls import runner
from air_magic.listeners import Listener
ranks, mlflow_on, log, pause = int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1", float(sys.argv[5])
if pause:  # as a notebook user: load the extension (helper, MLflow's preparation), then think for `pause` s
    from IPython.core.interactiveshell import InteractiveShell

    InteractiveShell.instance().run_line_magic("load_ext", "air_magic")
    time.sleep(pause)
from air_magic.tracking import prepare as _prepare

prepare_at = "the notebook's MLflow preparation " + ("still ran" if _prepare.running() else "was over") + " at the call"

class Recorder(Listener):
    def on_start(self, ctx):
        self.ctx = ctx

f = distributed(ranks, mlflow=mlflow_on)(job_logging)
spec = f.settings.spec(f.func, (True, log), {}, "job_logging")
rec = Recorder()
t0 = time.time()
result = owner().submit(spec, listeners=default_listeners(spec) + [rec])
back = time.time() - t0
shift = time.time() - rec.ctx.elapsed - t0  # the runner's clock starts after serializing the call
marks = {k: max(r[k] for r in result.values) - t0 for k in result.values[0]}
phases = [(name, at + shift) for name, at in rec.ctx.phases]
import os
from air_magic.launch.files.rundir import helper_log
from air_magic.owner import owner
from air_magic.owner.listeners import default_listeners
log = helper_log("supervisor", os.getpid())
helper = [line.strip() for line in log.read_text().splitlines() if "preloaded" in line or "preparation" in line]
print(json.dumps({"phases": phases, "ranks": marks, "results back": back, "helper": helper, "prepare": prepare_at}))
"""


def first_call(ranks: int, pause: float) -> None:
    import json
    import os
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    for label, on, log in (
        ("MLflow off", "0", "0"),
        ("MLflow on, ranks do not log", "1", "0"),
        ("MLflow on, ranks log one metric", "1", "1"),
    ):
        work = Path(tempfile.mkdtemp(prefix="air-magic-first-call-"))
        (work / "runs").mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update(AIR_MAGIC_RUNS_DIR=str(work / "runs"), AIR_MAGIC_DISPLAY="text")
        done = subprocess.run(
            [sys.executable, "-c", FIRST_CALL, str(root), str(ranks), on, log, str(pause)],
            check=False,
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode != 0:
            sys.exit(done.stderr[-3000:])
        data = json.loads(done.stdout.strip().splitlines()[-1])
        after = f", {pause:g} s after loading the extension" if pause else ""
        print(f"first call{after}, {label}: seconds from the call")
        for name, at in data["phases"]:
            print(f"  {'phase: ' + name:>36}: {at:.3f}")
        for name, at in data["ranks"].items():
            print(f"  {'ranks: ' + name:>36}: {at:.3f}")
        print(f"  {'results back':>36}: {data['results back']:.3f}")
        for line in [data["prepare"], *data["helper"]]:
            print(f"  {line}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--accelerator-type", default=None, help="CPU for gloo workers on a GPU machine; default: detected")
    ap.add_argument("--first-call", action="store_true", help="the first call of a fresh process, MLflow off and on")
    ap.add_argument("--pause", type=float, default=0.0, help="with --first-call: load the extension, wait this long")
    args = ap.parse_args()
    if args.first_call:
        first_call(args.ranks, args.pause)
        return
    for destroy in (True, False):
        f = distributed(args.ranks, accelerator_type=args.accelerator_type, mlflow=False, warm=True)(job)
        f.distributed(destroy)  # warm-up call
        rows = []
        for _ in range(args.repeat):
            t0 = time.time()
            res = f.run(destroy)
            back = time.time()
            phases = {k: max(r[k] for r in res.values) - t0 for k in res.values[0]}
            phases["ranks exited"] = max(r.exited_at or back for r in res.ranks) - t0
            phases["results back"] = back - t0
            rows.append(phases)
        print(f"destroy_process_group={destroy}: median seconds from the call, over {args.repeat} calls")
        for k in rows[0]:
            print(f"  {k:>14}: {statistics.median(r[k] for r in rows):.3f}")
        exit_s = statistics.median(r["ranks exited"] - r["destroyed"] for r in rows)
        back_s = statistics.median(r["results back"] - r["ranks exited"] for r in rows)
        print(f"  after the last return: process exit {exit_s:.3f} s, then results in the caller {back_s:.3f} s")


if __name__ == "__main__":
    main()
