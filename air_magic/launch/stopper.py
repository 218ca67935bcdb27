"""Stopping process trees: SIGTERM, a grace, then SIGKILL until nothing is left; and the Linux hooks around it.

One helper for everything air_magic stops: the supervisor's jobs (driven by
its own loop through `Stopper.tick`) and the local MLflow UI (`stop_tree`,
blocking); `close_by_eof` ends a helper that exits when its stdin closes
(the supervisor, the UI's watchdog). A helper that starts processes also becomes a child subreaper,
so what its children orphan is re-parented to it and can still be found;
a child asks to die with its parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable

import psutil

from .boot import INTERNAL_ERROR

#: Seconds between SIGTERM and SIGKILL, for every tree air_magic stops.
STOP_GRACE = 3.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_RETRY = 0.1


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def become_subreaper() -> None:
    """Orphans of our descendants are re-parented to us instead of to init."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(parent: int = 0) -> None:
    """SIGKILL this process when its parent goes; exit now if `parent` (a pid) is already gone."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent and os.getppid() != parent:
        os._exit(INTERNAL_ERROR)


def send(sig: int, procs: Iterable[psutil.Process], groups: Iterable[int] = ()) -> None:
    """Signal whole process groups (a worker leads its own: DataLoader workers are in it), then each process."""
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


class Stopper:
    """Stops what `find()` returns: SIGTERM at `begin`, SIGKILL from `grace` s later, again each tick until gone.

    `groups()` are the ranks' own processes, each leading its process group. With `stacks`, `begin` first has
    every process that answers STACKS_SIGNAL write its threads' stacks to its log (at most a fraction of a
    second, see stacks.py), so the log says where each rank was when it was stopped.
    """

    def __init__(
        self,
        find: Callable[[], Iterable[psutil.Process]],
        groups: Callable[[], Iterable[int]] = tuple,
        grace: float = STOP_GRACE,
        stacks: bool = True,
    ) -> None:
        self.find = find
        self.groups = groups
        self.grace = grace
        self.stacks = stacks
        self.kill_at: float | None = None

    @property
    def begun(self) -> bool:
        return self.kill_at is not None

    def begin(self, grace: float | None = None) -> None:
        if self.kill_at is None:
            self.grace = self.grace if grace is None else grace
            ranks = list(self.groups()) if self.stacks else []
            if ranks:
                from .stacks import STOPPING, request

                request(ranks, [p.pid for p in self.find()], why=STOPPING)
            self.kill_at = time.monotonic() + self.grace
            send(signal.SIGTERM, self.find(), self.groups())

    def tick(self) -> None:
        """Call often: past the grace, SIGKILL whatever is still there."""
        now = time.monotonic()
        if self.kill_at is not None and now >= self.kill_at:
            send(signal.SIGKILL, self.find(), self.groups())
            self.kill_at = now + _RETRY


def reap_children() -> None:
    """Collect every exited child of this process (a subreaper inherits zombies)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def stop_tree(find: Callable[[], Iterable[psutil.Process]], grace: float = STOP_GRACE, limit: float = 10.0) -> bool:
    """Stop what `find()` returns and wait until none is running (at most grace + `limit` s); True if all went."""
    stopper = Stopper(lambda: [p for p in find() if _running(p)], grace=grace, stacks=False)
    stopper.begin()
    deadline = time.monotonic() + grace + limit
    while time.monotonic() < deadline:
        reap_children()
        if not list(stopper.find()):
            return True
        stopper.tick()
        time.sleep(0.05)
    return False


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def close_by_eof(proc: subprocess.Popen[bytes], timeout: float, kill: Callable[[], None]) -> None:
    """End a helper that exits when its stdin closes; `kill` it if it has not gone after `timeout` s."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            kill()
        except OSError:
            pass
        proc.wait()
