"""`call.json`: a call's record in its run directory, live while it runs and final when it ends. The one owner of
that format (the handle rebuilt from it after a kernel restart is rebuilt.py).

The record says what the call was (name, front door, ranks, accelerator type), its status, when, its MLflow
run, each rank's state and exit code, and its error in one line; the ranks' logs, results and error records
beside it (launch/files/rundir.py) give the rest. While the call is live the record also names its owner
process (pid, kind: kernel, cli or detached), which holds a lock on `owner.lock` as long as it lives: a
reader in any process (`load`, `all_records`) sees a call whose owner died as failed, never running forever.
`CallRecord` is its one writer, held by the call's handle; `LiveRecord`, the listener the handle puts last, drives
it while the call runs and honours a cancel asked from another process (the `cancel` file, `request_cancel`). Not
for: running anything again.

Over 300 lines because the one format has its writer (live and final), its readers (one call, every call of
the machine, a rebuilt handle) and its control file together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ..errors import AirMagicError
from ..job import CallStatus, JobResult, JobSpec
from ..launch.files.rundir import RunDir, runs_root, write_private
from ..listeners import Listener, RunContext

#: The record's file name in the run directory.
RECORD = "call.json"
#: A call's statuses (job.CallStatus, the one list), by the names this format's readers use.
WAITING, RUNNING, FINISHED, FAILED, CANCELLED = (
    CallStatus.WAITING,
    CallStatus.RUNNING,
    CallStatus.FINISHED,
    CallStatus.FAILED,
    CallStatus.CANCELLED,
)
LIVE = CallStatus.LIVE
#: Seconds between two looks of a live call's owner at its cancel file.
_CANCEL_LOOK = 0.2


# -- writing --------------------------------------------------------------------------------------------
def _save(path: Path, changes: dict[str, Any]) -> dict[str, Any]:
    """Merge `changes` into the record of run directory `path` (written whole, then renamed: never half read)."""
    record = read(path) or {}
    record.update(changes)
    tmp = path / f".{RECORD}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)
        write_private(tmp, json.dumps(record).encode())
        tmp.replace(path / RECORD)
    return record


def _lock_owner(path: Path) -> int | None:
    """Lock the `owner.lock` of run directory `path` for this process: its descriptor, or None if another process
    holds it (or it cannot be opened)."""
    try:
        fd = os.open(RunDir(path).owner_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def request_cancel(path: Path) -> bool:
    """Ask the owner of the call in run directory `path` (any process of this user) to cancel it."""
    try:
        write_private(RunDir(path).cancel_flag, f"{time.time():.3f}\n".encode())
    except FileExistsError:
        return False
    return True


def cancel_requested(path: Path) -> bool:
    return RunDir(path).cancel_flag.exists()


class CallRecord:
    """The one writer of a call's `call.json`, held by the call's handle in its owner process: the first line
    (waiting, or running), what it waits for, its MLflow run, and the final line; it holds the owner lock from the
    first line to the last. (A reader that finds the owner dead makes the record final instead: `load`.)"""

    def __init__(self, path: Path, role: str = "kernel") -> None:
        self.path = path
        #: The kind of process that owns the call ("kernel", "cli" or "detached"), as the record names its owner.
        self.role = role
        self.begun = False
        self.ended = False
        #: The locked `owner.lock` while this process owns the call.
        self._lock: int | None = None

    def hold(self) -> bool:
        """This process owns the call: its `owner.lock` is locked until `release` (holding it again is harmless).
        False if another process holds it."""
        if self._lock is None:
            self._lock = _lock_owner(self.path)
        return self._lock is not None

    def release(self) -> None:
        """The call ended here: its owner lock is let go."""
        fd, self._lock = self._lock, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def begin(self, spec: JobSpec, status: str, **more: Any) -> None:
        """The live record of a call that waits or starts here, owned by this process."""
        self.hold()
        _save(
            self.path,
            {
                "id": self.path.name,
                "name": spec.name,
                "origin": spec.origin,
                "world_size": spec.world_size,
                "accelerator_type": spec.accelerator_type,
                "num_nodes": spec.num_nodes,
                "status": status,
                "started": time.time(),
                "ended": None,
                "owner": {"pid": os.getpid(), "role": self.role, "host": socket.gethostname()},
                **more,
            },
        )
        self.begun = True

    def waiting(self, why: str) -> None:
        """The live record says what the call waits for (GPUs or CPU slots held by others)."""
        _save(self.path, {"waiting_for": why})

    def running(self, spec: JobSpec, **more: Any) -> None:
        """The call started: running from now on (its first line, if it did not wait)."""
        if self.begun:
            self.hold()
            _save(self.path, {"status": RUNNING, "waiting_for": "", **more})
        else:
            self.begin(spec, RUNNING, **more)

    def update(self, fields: dict[str, Any]) -> None:
        """More of what the live call is (its MLflow run, once made)."""
        _save(self.path, fields)

    def end(self, result: JobResult | None, error: BaseException | None, **more: Any) -> None:
        """The final record (once), and the owner lock let go: the call ended here."""
        if self.ended:
            return
        self.ended = True
        _save(
            self.path,
            {
                "status": CallStatus.of(result, error),
                "ended": time.time(),
                "elapsed": result.elapsed if result is not None else None,
                "returncodes": [r.returncode for r in result.ranks] if result is not None else [],
                "states": [r.state.value for r in result.ranks] if result is not None else [],
                "error": None if error is None else f"{type(error).__name__}: {error}",
                "profiles": _profiles(self.path),
                "alerts": [dataclasses.asdict(a) for a in result.alerts] if result is not None else [],
                **more,
            },
        )
        self.release()


def _profiles(path: Path) -> list[dict[str, Any]]:
    """What every profile of the call found (`profile=N`'s, then each `handle.profile()`'s or Profile click's), as
    the profiling left it in the run directory."""
    found = []
    for summary in RunDir(path).profile_summaries():
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(summary.read_text()))
    return found


class LiveRecord(Listener):
    """Drives a call's `CallRecord` from what the runner does (running, its MLflow run, the end) and cancels the call
    when another process asks (`request_cancel`). The handle puts it last among its call's listeners, so the final
    record is written once the others (the MLflow run's end among them) are done."""

    def __init__(self, record: CallRecord, listeners: list[Listener], more: dict[str, Any] | None = None) -> None:
        self.record = record
        self.listeners = listeners
        self.more = more or {}
        self.ctx: RunContext | None = None
        self.run_id: str | None = None
        self.looked_at = 0.0

    def on_start(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.record.running(ctx.spec, **self.more)

    def poll(self) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        now = time.monotonic()
        if now - self.looked_at < _CANCEL_LOOK:
            return
        self.looked_at = now
        if not ctx.cancelled and cancel_requested(ctx.run_dir):
            ctx.cancel()
        if self.run_id is None:
            mlflow_run = self._mlflow_run()
            if mlflow_run["run_id"]:
                self.run_id = str(mlflow_run["run_id"])
                self.record.update(mlflow_run)

    def _mlflow_run(self) -> dict[str, Any]:
        """The call's MLflow run: its id and link, and the store and experiment it is in (any process showing
        the run makes its own link from them, tracking/ui.py `call_link`)."""
        found = next((x for x in self.listeners if getattr(x, "run_id", None)), None)
        link = self.ctx.links.get("mlflow") if self.ctx is not None else None
        return {
            "run_id": getattr(found, "run_id", None),
            "link": link,
            "tracking_uri": getattr(found, "tracking_uri", None),
            "experiment_id": getattr(found, "experiment_id", None),
        }

    def on_end(self, result: JobResult) -> None:
        if self.ctx is not None:
            self.record.end(result, result.error, **self._mlflow_run())


# -- reading --------------------------------------------------------------------------------------------
def read(path: Path) -> dict[str, Any] | None:
    """The record as written, or None (no record, or not readable)."""
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def owner_alive(path: Path, record: dict[str, Any]) -> bool:
    """The process that owns the live call of `path` still runs (its lock on owner.lock is held)."""
    lock = RunDir(path).owner_lock
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        pid = (record.get("owner") or {}).get("pid")
        return isinstance(pid, int) and psutil.pid_exists(pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


#: Told, once per call, by the process that finds its owner dead and marks it failed (the MLflow run's end:
#: tracking/orphans.py, plugged in by the owner and the command line).
_orphan_hooks: list[Callable[[dict[str, Any]], None]] = []


def on_orphaned(hook: Callable[[dict[str, Any]], None]) -> None:
    """Have `hook(record)` told of each call this process finds orphaned (its owner died) and marks failed."""
    if hook not in _orphan_hooks:
        _orphan_hooks.append(hook)


def owner_gone(record: dict[str, Any]) -> str:
    """The error of a call whose owner died before it ended."""
    owner = record.get("owner") or {}
    return f"OwnerGone: its owner, {owner.get('role', 'owner')} pid {owner.get('pid')}, died before the call ended"


def _mark_orphaned(path: Path) -> None:
    """The call of `path` lost its owner: the first reader makes its record final (failed, with when and why) and
    tells the hooks; a reader that finds another at it leaves it to that one."""
    try:
        fd = os.open(RunDir(path).owner_lock, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    try:
        record = read(path) or {}
        if record.get("status") not in LIVE:
            return
        record = _save(path, {"status": FAILED, "ended": time.time(), "error": owner_gone(record), "orphaned": True})
        for hook in _orphan_hooks:
            with contextlib.suppress(Exception):  # the record is final whatever a hook meets (a store gone)
                hook(record)
    finally:
        os.close(fd)


def load(path: Path) -> dict[str, Any] | None:
    """The record of run directory `path` with its status as it is now: a live call whose owner process is gone
    reads failed, naming that process (and the first reader makes that final, `_mark_orphaned`)."""
    record = read(path)
    if record is None:
        return None
    record["id"], record["run_dir"] = path.name, str(path)
    if record.get("status") in LIVE and not owner_alive(path, record):
        _mark_orphaned(path)
        record.update(read(path) or {})
        record["id"], record["run_dir"] = path.name, str(path)
        record["status"] = FAILED
        record["error"] = record.get("error") or owner_gone(record)
    return record


def all_records(root: Path | None = None) -> list[dict[str, Any]]:
    """Every call of this user on the machine that left a record (in every process's run directories), oldest
    first."""
    root = root or runs_root()
    found = []
    for path in root.iterdir():
        if path.is_dir() and not path.name.startswith(".") and (path / RECORD).exists():
            record = load(path)
            if record is not None:
                found.append(record)
    return sorted(found, key=lambda r: (r.get("started") or 0, r["id"]))


def find_dir(call_id: str, root: Path | None = None) -> Path:
    """The run directory of call `call_id`: its directory name, a unique prefix of it, or its path."""
    root = root or runs_root()
    given = Path(call_id)
    if given.is_absolute() and (given / RECORD).exists():
        return given
    names = [p.name for p in root.iterdir() if p.is_dir() and (p / RECORD).exists()]
    if call_id in names:
        return root / call_id
    matches = [n for n in names if n.startswith(call_id)]
    if len(matches) == 1:
        return root / matches[0]
    if not matches:
        raise AirMagicError(f"no call {call_id!r} on this machine (under {root}); `air-magic list` shows them.")
    raise AirMagicError(f"{call_id!r} names {len(matches)} calls ({', '.join(sorted(matches)[:5])}); give more of it.")
