"""The `air-magic` command line as users run it, a subprocess, with the runtime's workload files: a `torchrun` command
run once per node on CPU (its variables, parameters, a retry in fresh processes with a new MLflow run, per-attempt
logs), an attempt past `timeout_minutes` ending TIMEDOUT with the JSON events and an ALERT, the code snapshot taken
at `run`, a function workload, cancel and the idempotency token, and files refused with exit code 2 before anything
starts."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import in_order, mlflow_run

pytestmark = pytest.mark.slow

TRAIN = """\
import os, sys, time
import torch, torch.distributed as dist
import yaml

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
params = yaml.safe_load(open(os.environ["HYPERPARAMETERS_PATH"]))
print(f"rank {rank} of {dist.get_world_size()} sum {total.item()} lr {params['lr']} batch {os.environ['BATCH_SIZE']}",
      flush=True)
marks = os.environ["MARKS"]
if rank == 0 and not os.path.exists(os.path.join(marks, "failed-once")):
    open(os.path.join(marks, "failed-once"), "w").close()
    print("Segmentation fault (a simulated one)", flush=True)
    sys.exit(3)
if rank == 0 and os.environ.get("HANG"):
    print("hanging", flush=True)
    time.sleep(600)
if rank == 0:
    import mlflow
    mlflow.log_metric("loss", 0.25)
dist.destroy_process_group()
"""

# The runtime's own form: 8 H100 on one node, torchrun over them; the test adapts it with --override only.
JOB = """\
experiment_name: cli-tests
mlflow_run_name: ddp
compute:
  num_accelerators: 8
  accelerator_type: GPU_8xH100
code_source:
  type: snapshot
  snapshot:
    root_path: code
env_variables:
  BATCH_SIZE: '32'
parameters:
  lr: 0.1
max_retries: 1
timeout_minutes: 5
command: |
  echo "node $NODE_RANK of $NUM_NODES, $LOCAL_WORLD_SIZE local, RANK=${RANK:-unset}, in $PWD"
  torchrun --nproc_per_node=2 $CODE_SOURCE_PATH/train.py
"""

FUNCTIONS = """\
import os

def train(lr, steps=1, stop=False):
    print("training with", lr, steps, flush=True)
    if stop and os.environ["RANK"] == "1":
        x = lr * 10
        breakpoint()
    return {"rank": int(os.environ["RANK"]), "lr": lr, "steps": steps}
"""

FUNCTION_JOB = """\
compute: {num_accelerators: 2, accelerator_type: CPU}
function: fns:train
args: [0.1]
kwargs: {steps: 3}
code_source: {type: snapshot, snapshot: {root_path: code}}
max_retries: 0
"""

CPU = ("--override", "compute.accelerator_type=CPU", "--override", "compute.num_accelerators=2")


#: The files of the directory the fixture `cli` (tests/conftest.py) runs `air-magic` in.
CLI_FILES = {"code/train.py": TRAIN, "code/fns.py": FUNCTIONS, "fjob.yaml": FUNCTION_JOB}


@pytest.fixture(scope="module", autouse=True)
def job_file(cli):
    """The torchrun job in the `cli` directory, told where its ranks leave their marks."""
    (cli.root / "marks").mkdir(exist_ok=True)
    (cli.root / "job.yaml").write_text(
        JOB.replace("  BATCH_SIZE: '32'\n", f"  BATCH_SIZE: '32'\n  MARKS: {cli.root / 'marks'}\n")
    )


def _data(done: subprocess.CompletedProcess[str]):
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.splitlines()[-1])["data"]


def _mlflow(cli, run_id: str):
    run = mlflow_run(cli, run_id)
    return run["name"], run["experiment"], run["metrics"], run["tags"]


def test_a_torchrun_command_runs_once_per_node_and_its_retry_starts_fresh(cli):
    """The runtime's torchrun file, with CPU overrides: the command runs once on the node, without RANK, in the
    snapshot, with the runtime's variables, env_variables and parameters; torchrun's 2 ranks meet; the first
    attempt fails (its fatal line an alert, recorded and tagged on its MLflow run) and the retry runs in fresh
    processes with a new MLflow run; logs are kept per attempt."""
    done = cli("run", "-f", "job.yaml", "--watch", *CPU)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = done.stdout.split("Submitted workload with Run ID: ", 1)[1].split()[0]
    snapshot = cli.root / "runs" / run_id / "code_source" / "code"
    assert f"[node 0] node 0 of 1, 2 local, RANK=unset, in {snapshot}" in done.stdout
    for rank in (0, 1):
        assert f"rank {rank} of 2 sum 3.0 lr 0.1 batch 32" in done.stdout
    assert "ERROR: Script failed with exit code 1" in done.stdout
    assert "SUCCESS" in done.stdout.splitlines()[-1]
    got = _data(cli("get", "run", run_id, "-o", "json"))
    assert (got["status"], got["attempt_number"], got["max_retries"]) == ("SUCCESS", 1, 1)
    first = cli("logs", run_id, "--retry", "0", "--node", "0")
    assert "ERROR: Script failed with exit code 1" in first.stdout and "Script failed" not in cli("logs", run_id).stdout
    attempt_run = json.loads((cli.root / "runs" / run_id / "attempts" / "attempt_1" / "node_0.json").read_text())
    assert attempt_run["mlflow_run_id"] != got["mlflow_run_id"]
    name, experiment, metrics, _ = _mlflow(cli, attempt_run["mlflow_run_id"])
    assert (name, experiment, metrics["loss"]) == ("ddp", "cli-tests", 0.25)
    assert all(metrics[f"system/command_rank_{r}/memory_mib"] > 0 for r in (0, 1)), (
        metrics
    )  # the node's watch of its ranks
    _, _, metrics, tags = _mlflow(cli, got["mlflow_run_id"])  # the failed first attempt's run
    assert "loss" not in metrics
    # the fatal line as the node's output had it: two ranks' unbuffered prints may share a line of the node's log
    assert tags["air_magic.alert_0"].startswith("segfault on node 0: Segmentation fault (a simulated one)"), tags
    assert {"kind": "segfault", "attempt": 0, "node": 0} == {
        k: got["alerts"][0][k] for k in ("kind", "attempt", "node")
    }


def test_an_attempt_past_its_timeout_ends_timedout_with_json_events_and_an_alert(cli):
    """`--watch -o json` of the torchrun file: SUBMITTED, STATUS lines, an ALERT before the fatal line; the first
    attempt fails, the retry hangs in torchrun's rank 0 past timeout_minutes and every process of its script is
    stopped; the run ends TIMEDOUT and the exit code is 1."""
    (cli.root / "marks-timeout").mkdir()
    done = cli(
        "run",
        "-f",
        "job.yaml",
        "--watch",
        "-o",
        "json",
        *CPU,
        "--override",
        "timeout_minutes=1",
        "--override",
        f"env_variables.MARKS={cli.root / 'marks-timeout'}",
        "--override",
        "env_variables.HANG=1",
        timeout=400,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert events[0]["type"] == "SUBMITTED"
    statuses = [e["status"] for e in events if e.get("type") == "STATUS"]
    assert statuses[0] in ("PENDING", "RUNNING") and statuses[-2:] == ["RUNNING", "TIMEDOUT"]
    lines = [e for e in events if e.get("type") in ("ALERT", "LOG")]
    found = next(i for i, e in enumerate(lines) if "Segmentation fault" in e["line"])
    assert lines[found]["type"] == "ALERT" and lines[found]["kind"] == "segfault" and lines[found]["node"] == 0
    assert lines[found + 1]["type"] == "LOG" and lines[found + 1]["line"] == lines[found]["line"]
    assert events[-1]["data"]["status"] == "TIMEDOUT"
    run_id = events[0]["run_id"]
    assert _data(cli("get", run_id, "--json"))["status"] == "TIMEDOUT"
    assert "hanging" in cli("logs", run_id).stdout
    assert "timed out after 1 minute(s)" in cli("logs", run_id).stdout
    left = [
        p.info for p in psutil.process_iter(["pid", "cmdline"]) if f"{run_id}/" in " ".join(p.info["cmdline"] or [])
    ]
    assert left == []


def test_the_code_is_the_snapshot_taken_at_run_even_for_a_retry(cli):
    """Edits to root_path after `run` returns change neither the run nor its retry: both attempts read the file as
    it was; the run ends FAILED with exit code 1 from `logs --follow`."""
    (cli.root / "code" / "version.txt").write_text("v1\n")
    started = _data(cli("run", "-f", "job.yaml", "-o", "json", *CPU, "--override", "command=cat version.txt; exit 4"))
    (cli.root / "code" / "version.txt").write_text("v2\n")
    follow = cli("logs", started["run_id"], "--follow")
    assert follow.returncode == 1, follow.stdout + follow.stderr
    for attempt in (0, 1):
        lines = cli("logs", started["run_id"], "--retry", str(attempt)).stdout.splitlines()
        assert lines[0] == "v1" and lines[-1].startswith("ERROR: Script failed with exit code 4"), lines
    assert _data(cli("get", started["run_id"], "-o", "json"))["status"] == "FAILED"


def test_a_function_workload_returns_each_ranks_value(cli):
    """function: module:name (air_magic's) runs on every rank; `logs --follow` waits for the end; `get` gives
    each rank's value (its repr); `logs --rank 1` that rank's lines."""
    started = _data(cli("run", "-f", "fjob.yaml", "-o", "json"))
    assert Path(started["run_dir"]).name == started["run_id"] and started["status"] in ("PENDING", "RUNNING")
    follow = cli("logs", started["run_id"], "--follow")
    assert follow.returncode == 0, follow.stdout + follow.stderr
    got = _data(cli("get", started["run_id"], "--json"))
    assert got["status"] == "SUCCESS"
    assert [r["value"] for r in got["ranks"]] == [repr({"rank": r, "lr": 0.1, "steps": 3}) for r in (0, 1)]
    assert "training with 0.1 3" in cli("logs", started["run_id"], "--rank", "1").stdout
    listed = _data(cli("list", "--all-status", "--filter", "status=success", "-o", "json"))["runs"]
    assert started["run_id"] in [r["run_id"] for r in listed]


def test_a_function_ranks_breakpoint_is_answered_by_attach(cli):
    """Rank 1 of a function workload stops at breakpoint(); `attach` shows its prompt, answers `p x` and `c` from
    standard input, and exits 0 when the run ends SUCCESS."""
    started = _data(cli("run", "-f", "fjob.yaml", "-o", "json", "--override", "kwargs.stop=true"))
    attached = cli("attach", started["run_id"], input="p x\nc\n", timeout=180)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert in_order(attached.stdout, "(Pdb rank 1) p x\n", "1.0\n", "(Pdb rank 1) c\n"), attached.stdout
    assert _data(cli("get", started["run_id"], "--json"))["status"] == "SUCCESS"


def test_a_repeat_run_with_the_same_token_starts_nothing_and_cancel_ends_it(cli):
    """A second `run --idempotency-key K` returns the first run; `cancel` ends it CANCELED, `attach` exits 1,
    and `list` (active runs) no longer shows it."""
    args = (
        "run",
        "-f",
        "job.yaml",
        "-o",
        "json",
        *CPU,
        "--idempotency-key",
        "nightly-1",
        "--override",
        "command=echo started; sleep 600",
    )
    first = _data(cli(*args))
    second = _data(cli(*args))
    assert second["run_id"] == first["run_id"] and second["existing"] is True
    assert len([p for p in (cli.root / "runs").iterdir() if p.name == first["run_id"]]) == 1
    log = Path(first["run_dir"]) / "rank-0.log"
    deadline = time.monotonic() + 300
    while "started" not in log.read_text():  # the node runs: its first line is in the log
        assert time.monotonic() < deadline, (Path(first["run_dir"]) / "owner.log").read_text()
        time.sleep(0.2)
    assert first["run_id"] in [r["run_id"] for r in _data(cli("list", "-o", "json"))["runs"]]
    cancelled = _data(cli("cancel", first["run_id"], "-o", "json"))
    assert cancelled["cancelled"] == [first["run_id"]] and cancelled["failed"] == []
    attached = cli("attach", first["run_id"])
    assert attached.returncode == 1, attached.stdout + attached.stderr
    assert _data(cli("get", first["run_id"], "-o", "json"))["status"] == "CANCELED"
    assert first["run_id"] not in [r["run_id"] for r in _data(cli("list", "-o", "json"))["runs"]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--override", "compute.num_acelerators=2"),
            "unknown field 'compute.num_acelerators'; did you mean 'num_accelerators'?",
        ),
        ((), "this machine has no GPU; run on its CPU with --override compute.accelerator_type=CPU"),
        ((*CPU, "--override", "secrets.HF_TOKEN=hf/token"), "secrets not found on this machine: HF_TOKEN (hf/token"),
    ],
)
def test_a_file_that_cannot_run_is_refused_with_exit_code_2_and_nothing_started(cli, args, message):
    """A misspelled field, GPUs on a machine without one, a missing secret: one line naming it and the fix,
    exit code 2, no traceback, no run directory; with -o json, the error envelope."""
    before = set((cli.root / "runs").iterdir())
    done = cli("run", "-f", "job.yaml", *args)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("air-magic: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert set((cli.root / "runs").iterdir()) == before
    error = json.loads(cli("run", "-f", "job.yaml", *args, "-o", "json").stdout)["error"]
    assert (error["code"], error["kind"], error["retryable"]) == ("INVALID_ARGS", "PERMANENT", False)
    assert message in error["message"]
