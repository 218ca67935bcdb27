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
from helpers import air_magic_cli, kernel_env, process_env, wait_until

pytestmark = pytest.mark.slow

HOLDER = """
from air_magic.calls import ledger
from air_magic.owner import owner
owner("cli").ledger.take("call hold-1", 2, ledger.CPU, "call hold-1 (holder)")
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


def _waits_for(cli, call_id: str) -> dict:
    """The record of a run once it says what it waits for (it must not have started)."""
    seen: dict = {}

    def waiting() -> bool:
        seen.update(json.loads(cli("get", call_id, "--json").stdout)["data"])
        assert seen["status"] == "PENDING", seen
        return bool(seen["waiting_for"])

    wait_until(waiting, 300, f"run {call_id} never said what it waits for")
    return seen


@pytest.fixture
def keeping_kernel(new_kernel, tmp_path):
    """A kernel with air_magic loaded on 2 CPU slots, and `air-magic` in the same directory with the 2-slot job: the
    kernel, and the command line as a partial."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    env = kernel_env(tmp_path, AIR_MAGIC_CPU_SLOTS="2")
    kernel = new_kernel(env=env, cwd=tmp_path)
    kernel.execute("%load_ext air_magic").check()
    return kernel, partial(air_magic_cli, tmp_path, process_env(env))


def _run_to_its_end(cli, call_id: str) -> None:
    followed = cli("logs", call_id, "--follow")
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "[rank 1] ran on rank 1" in followed.stdout


def test_a_live_sessions_slots_are_leased_machine_wide_until_it_ends(keeping_kernel):
    """A kernel's session holds its 2 CPU slots for as long as its ranks live, between cells too: `air-magic run` of
    a 2-slot file waits and names the session and the call that made it (kernel pid); `%distributed_session --end`
    gives the slots back at once and the run goes on to its end."""
    kernel, cli = keeping_kernel
    kernel.execute(
        "%%distributed --session s --gpus 2 --accelerator-type CPU --no-mlflow --keep-alive 600\nkept = 1"
    ).check()
    first = kernel.value("__import__('air_magic.owner', fromlist=['owner']).owner().table.all()[-1].id")
    started = json.loads(cli("run", "-f", "job.yaml", "--json").stdout)["data"]
    got = _waits_for(cli, started["id"])
    assert f"session 's' kept by call {first.strip(chr(39))}" in got["waiting_for"], got
    assert f"(kernel pid {kernel.pid})" in got["waiting_for"], got
    kernel.execute("%distributed_session --end s").check()
    _run_to_its_end(cli, started["id"])


def test_a_run_that_needs_a_kernels_idle_hot_ranks_ends_them_and_runs(keeping_kernel):
    """A kernel's idle hot ranks (keep_alive) keep their 2 CPU slots leased; `air-magic run` of a 2-slot file asks
    that kernel to end them (a session would be waited for), so the run starts and finishes while the kernel lives,
    and the kernel keeps no world afterwards."""
    kernel, cli = keeping_kernel
    kernel.execute("%%distributed --gpus 2 --accelerator-type CPU --no-mlflow --keep-alive 600\nkept = 1").check()
    worlds = "len(__import__('air_magic.owner', fromlist=['owner']).owner().keeper.worlds())"
    assert kernel.value(worlds) == "1"
    started = json.loads(cli("run", "-f", "job.yaml", "--json").stdout)["data"]
    _run_to_its_end(cli, started["id"])
    assert kernel.value(worlds) == "0"
