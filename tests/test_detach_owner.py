"""A call's owner that dies (kill -9) leaves a record that every process reads as failed, naming that owner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

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
        assert record["error"] == f"OwnerGone: its cli process (pid {owner.pid}) ended before the call did"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
