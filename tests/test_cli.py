"""The `air-magic` command line as users run it, a subprocess: a command and a function workload on 2 CPU ranks,
--watch's exit codes, one MLflow run per run that a command's script logs into, list/get/logs in JSON, cancel, and
a misspelled field refused with exit code 2 before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """\
import os
import mlflow
rank = int(os.environ["RANK"])
print("hello from rank", rank, "of", os.environ["WORLD_SIZE"], "in", os.environ["CODE_SOURCE_PATH"], flush=True)
if rank == 0:
    mlflow.log_metric("loss", 0.25)
"""

FUNCTIONS = """\
import os

def train(lr, steps=1):
    print("training with", lr, steps, flush=True)
    return {"rank": int(os.environ["RANK"]), "lr": lr, "steps": steps}
"""

COMMAND_JOB = """\
experiment_name: cli-tests
mlflow_run_name: hello
compute:
  num_accelerators: 2
  accelerator_type: CPU
command: python train.py
code_source:
  root_path: code
environment:
  dependencies: ["mlflow>=2"]
timeout: 600
"""

FUNCTION_JOB = """\
compute: {num_accelerators: 2, accelerator_type: CPU}
function: fns:train
args: [0.1]
kwargs: {steps: 3}
code_source: {root_path: code}
"""


#: The files of the directory the fixture `cli` (tests/conftest.py) runs `air-magic` in.
CLI_FILES = {"code/train.py": SCRIPT, "code/fns.py": FUNCTIONS, "job.yaml": COMMAND_JOB, "fjob.yaml": FUNCTION_JOB}


def _json(done: subprocess.CompletedProcess[str]):
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_command_workload_runs_on_every_rank_and_logs_into_its_mlflow_run(cli):
    """`run -f job.yaml --watch` prints each rank's lines prefixed by rank, exits 0, and its one MLflow run, named
    mlflow_run_name in experiment_name, has the metric the script logged."""
    done = cli("run", "-f", "job.yaml", "--watch")
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank} of 2 in {cli.root / 'code'}" in done.stdout
    assert "finished" in done.stdout.splitlines()[-1]
    record = _json(cli("list", "--json"))[-1]
    got = _json(cli("get", record["id"][:20], "--json"))
    assert got["status"] == "finished" and got["owner"]["role"] == "cli"
    check = (
        "import json, mlflow, sys; r = mlflow.get_run(sys.argv[1]); "
        "print(json.dumps([r.info.run_name, mlflow.get_experiment(r.info.experiment_id).name, r.data.metrics]))"
    )
    name, experiment, metrics = json.loads(
        subprocess.run(
            [sys.executable, "-c", check, got["mlflow"]["run_id"]],
            cwd=cli.root,
            env=cli.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert (name, experiment, metrics["loss"]) == ("hello", "cli-tests", 0.25)


def test_a_function_workload_returns_each_ranks_value_to_get_and_logs(cli):
    """`run --json` returns at once with the id and run directory; `logs --follow` waits for the end; `get --json`
    gives each rank's value (its repr); `logs --rank 1 --json` that rank's lines; `list` its status."""
    started = _json(cli("run", "-f", "fjob.yaml", "--json"))
    assert Path(started["run_dir"]).name == started["id"]
    assert started["status"] in ("waiting", "running")
    follow = cli("logs", started["id"], "--follow")
    assert follow.returncode == 0, follow.stdout + follow.stderr
    got = _json(cli("get", started["id"], "--json"))
    assert got["status"] == "finished"
    assert [r["value"] for r in got["ranks"]] == [repr({"rank": r, "lr": 0.1, "steps": 3}) for r in (0, 1)]
    logs = _json(cli("logs", started["id"], "--rank", "1", "--json"))
    assert "training with 0.1 3" in logs["logs"]["1"]
    listed = {r["id"]: r["status"] for r in _json(cli("list", "--json"))}
    assert listed[started["id"]] == "finished"


def test_a_failing_command_exits_non_zero_and_a_cancelled_one_130(cli):
    """--watch exits 1 when a rank's command fails; a run cancelled from another `air-magic cancel` ends cancelled,
    and `attach` exits 130."""
    failed = cli("run", "-f", "job.yaml", "--watch", "--override", "command=exit 3", "--override", "experiment_name=x")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "the command exited with code 3" in failed.stdout
    started = _json(
        cli(
            "run",
            "-f",
            "job.yaml",
            "--json",
            "--override",
            "command=echo started; sleep 600",
            "--override",
            "timeout=900",
        )
    )
    deadline = time.monotonic() + 300
    log = Path(started["run_dir"]) / "rank-0.log"
    while "started" not in log.read_text():  # the ranks run: their first line is in the log
        assert time.monotonic() < deadline, (Path(started["run_dir"]) / "owner.log").read_text()
        time.sleep(0.2)
    cancelled = _json(cli("cancel", started["id"], "--json"))
    assert cancelled == [{"id": started["id"], "cancel_requested": True, "already_requested": False}]
    attached = cli("attach", started["id"])
    assert attached.returncode == 130, attached.stdout + attached.stderr
    assert _json(cli("get", started["id"], "--json"))["status"] == "cancelled"


def test_a_misspelled_field_is_refused_with_exit_code_2_and_nothing_started(cli):
    """An unknown field is one line naming it and the close name, exit code 2, no traceback, no run directory."""
    before = set((cli.root / "runs").iterdir())
    done = cli("run", "-f", "job.yaml", "--override", "compute.num_acelerators=2")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "air-magic: error: unknown field 'compute.num_acelerators'; did you mean 'num_accelerators'?"
    )
    assert "Traceback" not in done.stderr + done.stdout
    assert set((cli.root / "runs").iterdir()) == before
