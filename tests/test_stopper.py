"""Stopping real process trees: SIGTERM first, SIGKILL after the grace, nothing left behind."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from helpers import wait_until

from air_magic.launch.stopper import Stopper, stop_tree

pytestmark = pytest.mark.slow

_IGNORES_TERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def _start(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.readline().strip() == "ready"
    return proc


def _live(proc: psutil.Process) -> bool:
    """Still running: neither gone nor a zombie (this process may be the subreaper its orphan is reparented to)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _tree(proc: subprocess.Popen[str]):
    def find():
        try:
            root = psutil.Process(proc.pid)
            return [p for p in [root, *root.children(recursive=True)] if p.status() != psutil.STATUS_ZOMBIE]
        except psutil.Error:
            return []

    return find


def test_a_process_that_obeys_sigterm_ends_at_begin():
    """SIGTERM alone ends a well-behaved process: it exits by that signal, before any kill."""
    proc = _start("import time; print('ready', flush=True); time.sleep(60)")
    stopper = Stopper(_tree(proc), lambda: [proc.pid], grace=30)
    stopper.begin()
    assert proc.wait(10) == -15


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace():
    """A process ignoring SIGTERM survives the grace, then tick() SIGKILLs it."""
    proc = _start(_IGNORES_TERM)
    stopper = Stopper(_tree(proc), grace=0.3)
    stopper.begin()
    time.sleep(0.1)
    stopper.tick()
    assert proc.poll() is None, "killed before its grace was over"
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        stopper.tick()
        time.sleep(0.05)
    assert proc.returncode == -9


def test_stop_tree_ends_children_too():
    """stop_tree ends a process and the child it started, both ignoring SIGTERM, and reports success."""
    child = (
        "import signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"subprocess.Popen([sys.executable, '-c', {_IGNORES_TERM!r}]).wait()"
    )
    proc = _start(child)
    find = _tree(proc)
    grandchild = [p for p in find() if p.pid != proc.pid]
    assert len(grandchild) == 1
    try:
        assert stop_tree(find, grace=0.3, limit=10)
        proc.wait(5)
        # killed, though its end may come a moment later on a busy machine (it was a zombie or still "running" when
        # read at once); one that was never sent SIGKILL would ignore TERM and sleep on for a minute
        wait_until(lambda: not _live(grandchild[0]), 10, "the grandchild ends after its SIGKILL")
    finally:
        for p in grandchild:
            try:
                p.kill()
            except psutil.Error:
                pass
