"""Asking a live process for its stacks (air_magic/launch/stacks.py): real processes, a real signal."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from air_magic.launch import stacks
from air_magic.launch.files.stack_dumps import parse
from air_magic.launch.stacks import STOPPING

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


_CHILD = """
import os, sys, time
sys.path.insert(0, {root!r})
from air_magic.launch import stacks
if {install}:
    stacks.install()
def stuck_in_data_loading():
    print("ready", flush=True)
    time.sleep(60)
if {fork} and os.fork() == 0:
    def in_a_forked_child():
        time.sleep(60)
    in_a_forked_child()
stuck_in_data_loading()
"""


def _start(tmp_path: Path, install: bool, fork: bool = False) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "rank-0.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    code = _CHILD.format(root=str(ROOT), install=install, fork=fork)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=fd, stderr=fd, start_new_session=True)
    os.close(fd)
    deadline = time.monotonic() + 30
    while "ready" not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.05)
    return proc, log


@pytest.mark.skipif(stacks.STACKS_SIGNAL is None, reason="no real-time signals here")
def test_a_request_writes_the_stacks_of_a_process_and_its_forked_child_in_turn(tmp_path):
    """A rank blocked in time.sleep and the child it forked each write a whole dump to the shared log; both live on;
    a second stop request right away is not sent, live requests always are."""
    proc, log = _start(tmp_path, install=True, fork=True)
    try:
        import psutil

        children = [c.pid for c in psutil.Process(proc.pid).children()]
        assert stacks.request([proc.pid], children, why=STOPPING) == 2
        dumps = parse(log.read_text())
        assert [d.of_rank for d in dumps] == [True, False]
        assert dumps[0].user_frame().function == "stuck_in_data_loading"
        assert dumps[1].user_frame().function == "in_a_forked_child" and f"child of pid {proc.pid}" in dumps[1].role
        assert proc.poll() is None and all(psutil.pid_exists(c) for c in children)
        assert stacks.request([proc.pid], why=STOPPING) == 0, "the same stop heard twice is answered once"
        assert stacks.request([proc.pid]) == stacks.request([proc.pid]) == 1, "each live request is answered"
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.skipif(stacks.STACKS_SIGNAL is None, reason="no real-time signals here")
def test_a_process_that_does_not_answer_the_signal_is_never_sent_it(tmp_path):
    """A process without the handler (to which the signal would be fatal) is left alone, and its log untouched."""
    proc, log = _start(tmp_path, install=False)
    try:
        before = log.read_text()
        assert stacks.request([proc.pid]) == 0
        time.sleep(0.2)
        assert proc.poll() is None and log.read_text() == before
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
