"""Machine-wide leases between real processes: a run waits for CPU slots another process holds and says who holds
them; the holder killed with SIGKILL frees them, and the run goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial

import pytest
from helpers import air_magic_cli, kernel_env, process_env

pytestmark = pytest.mark.slow

HOLDER = """
from air_magic.calls import leases, ledger
leases.set_role("cli")
ledger.node().take("call hold-1", 2, ledger.CPU, "call hold-1 (holder)")
print("HELD", flush=True)
import time
time.sleep(3600)
"""

JOB = """\
compute: {num_accelerators: 2, accelerator_type: CPU}
function: fns:hello
max_retries: 0
"""

FUNCTIONS = """\
import os

def hello():
    print("ran on rank", os.environ["RANK"], flush=True)
"""


def test_a_run_waits_for_slots_another_process_holds_until_that_process_is_killed(tmp_path):
    """With 2 CPU slots held by another process, `air-magic run` waits and its record names the holder (its call,
    kind and pid); after `kill -9` of the holder the run takes the slots and finishes."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    env = process_env({**kernel_env(tmp_path), "AIR_MAGIC_CPU_SLOTS": "2"})
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"

        cli = partial(air_magic_cli, tmp_path, env)

        started = json.loads(cli("run", "-f", "job.yaml", "--json").stdout)["data"]
        deadline = time.monotonic() + 300
        while True:
            got = json.loads(cli("get", started["id"], "--json").stdout)["data"]
            if got["waiting_for"]:
                break
            assert got["status"] == "PENDING" and time.monotonic() < deadline, got
            time.sleep(0.2)
        assert got["waiting_for"] == f"2 CPU slot(s); 0 of 2 free, held by call hold-1 (holder) (cli pid {holder.pid})"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        followed = cli("logs", started["id"], "--follow")
        assert followed.returncode == 0, followed.stdout + followed.stderr
        assert "[rank 1] ran on rank 1" in followed.stdout
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
