"""The notebook side of the supervisor: start it, send it jobs, hear what its workers do.

The supervisor (supervisor.py) is one small process per kernel, in its own
session, that starts and stops the workers. This module talks to it over
its stdin/stdout pipes with one JSON object a line. When the kernel dies,
the supervisor reads end-of-file on stdin and stops every worker it has.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import AirMagicError

_PKG_PARENT = str(Path(__file__).resolve().parent.parent)
_BOOT = (
    "import sys; sys.path.insert(0, {parent!r}); "
    "from air_magic.supervisor import main; main()"
)


class JobHandle:
    """Events of one job, in the order the supervisor saw them."""

    def __init__(self, client: SupervisorClient, job_id: str) -> None:
        self.client = client
        self.job_id = job_id
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self, reason: str, grace: float) -> None:
        """Ask for every process of the job to be ended: SIGTERM, then SIGKILL after `grace`."""
        self.client.send({"op": "stop", "job": self.job_id, "reason": reason, "grace": grace})


class SupervisorClient:
    """One running supervisor process and the thread that reads its events."""

    def __init__(self, log_path: Path, warm: bool) -> None:
        self.log_path = log_path
        self.warm = warm
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT.format(parent=_PKG_PARENT), *(["--warm"] if warm else [])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fd,
                start_new_session=True,  # a kernel interrupt must reach workers only through us
                close_fds=True,
            )
        finally:
            os.close(fd)
        self._jobs: dict[str, JobHandle] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="air_magic-supervisor-events", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                handle = self._jobs.get(event.get("job", ""))
            if handle is not None:
                handle.events.put(event)
        with self._lock:
            handles = list(self._jobs.values())
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        for handle in handles:
            handle.events.put({"event": "supervisor-died", "returncode": code, "log": str(self.log_path)})

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self._lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise AirMagicError(
                    f"air_magic's supervisor process is gone (its log: {self.log_path}); "
                    "the next call starts a new one."
                ) from exc

    def launch(self, job_id: str, request: dict[str, Any]) -> JobHandle:
        handle = JobHandle(self, job_id)
        with self._lock:
            self._jobs[job_id] = handle
        self.send({"op": "launch", "job": job_id, **request})
        return handle

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def retire(self) -> None:
        """Let the supervisor finish the jobs it has, then exit; new jobs go to a new one."""
        try:
            self.send({"op": "retire"})
        except AirMagicError:
            pass

    def close(self, timeout: float = 10.0) -> None:
        """End the supervisor; it stops whatever workers it still has first."""
        close_by_eof(self.proc, timeout, self.proc.kill)


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


_client: SupervisorClient | None = None
_client_lock = threading.Lock()


def warm_default() -> bool:
    """Warm start unless AIR_MAGIC_WARM is 0/false/no/off."""
    return os.environ.get("AIR_MAGIC_WARM", "1").strip().lower() not in {"0", "false", "no", "off"}


def supervisor(runs_root: Path, replace: SupervisorClient | None = None) -> SupervisorClient:
    """The kernel's supervisor, started on first use, again if it died, or anew when `replace` went stale."""
    global _client
    with _client_lock:
        if replace is not None and _client is replace:
            replace.retire()
            _client = None
        if _client is None or not _client.alive:
            _client = SupervisorClient(runs_root / f"supervisor-{os.getpid()}.log", warm_default())
        return _client


def shutdown() -> None:
    """Stop the supervisor and everything it runs (at exit, or on %unload_ext)."""
    global _client
    with _client_lock:
        client, _client = _client, None
    if client is not None:
        client.close()


atexit.register(shutdown)
