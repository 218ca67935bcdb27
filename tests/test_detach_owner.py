"""A call's owner that dies (kill -9) leaves a record that every process reads as failed, naming that owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial

import psutil
import pytest
from helpers import air_magic_cli, kernel_env, process_env, wait_until

from air_magic.calls import record as call_record

pytestmark = pytest.mark.slow

HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_call_whose_owner_was_killed_reads_failed_naming_it(tmp_path):
    """While another process holds owner.lock the call is running; after its kill -9 the same record reads failed."""
    run = tmp_path / "20260101-000000-train-abcdefgh"
    run.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", HOLD, str(run / "owner.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "held"
        call_record._save(run, {"id": run.name, "status": "running", "owner": {"pid": owner.pid, "role": "cli"}})
        assert call_record.load(run)["status"] == "running"  # type: ignore[index]
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        record = call_record.load(run)
        assert record is not None and record["status"] == "failed"
        assert record["error"] == f"OwnerGone: its owner, cli pid {owner.pid}, died before the call ended"
        final = call_record.read(run)
        assert final is not None and final["status"] == "failed" and final["orphaned"], "made final on disk"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_a_killed_owners_mlflow_run_is_ended_failed_by_the_first_process_that_reads_the_call(tmp_path):
    """`air-magic run` whose owner process is killed with SIGKILL mid-call: `air-magic get` reads the call failed,
    naming the owner that died, and the call's MLflow run, left RUNNING by its owner, is FAILED from then on."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "job.yaml").write_text(
        "experiment_name: orphans\n"
        "compute: {num_accelerators: 1, accelerator_type: CPU}\n"
        "command: echo started; sleep 600\n"
    )
    env = process_env(kernel_env(tmp_path))
    cli = partial(air_magic_cli, tmp_path, env)
    started = json.loads(cli("run", "-f", "job.yaml", "--json").stdout)["data"]
    path = tmp_path / "runs" / started["run_id"]
    seen: dict = {}

    def running_with_a_run() -> bool:
        seen.update(call_record.read(path) or {})
        return bool(seen.get("run_id")) and "started" in (path / "rank-0.log").read_text(errors="replace")

    wait_until(running_with_a_run, 300, "the call never started with an MLflow run")
    owner = seen["owner"]["pid"]
    os.kill(owner, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(owner) or psutil.Process(owner).status() == "zombie", 60, "owner lives")
    got = json.loads(cli("get", started["run_id"], "--json").stdout)["data"]
    assert got["status"] == "FAILED" and got["air_magic_status"] == "failed", got
    assert f"its owner, cli pid {owner}, died" in got["error"], got
    from mlflow import MlflowClient

    run = MlflowClient(seen["tracking_uri"]).get_run(seen["run_id"])
    assert run.info.status == "FAILED"
    assert f"pid {owner}" in run.data.tags["air_magic.ended_by"]
