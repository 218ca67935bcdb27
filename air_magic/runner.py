"""run(spec) -> JobResult: the one path every call takes.

The runner serializes the call, lays out the run directory, asks the
supervisor for workers, tails their logs into the listeners, enforces the
timeout, turns Ctrl-C and Cancel into a stop, and turns what the ranks left
behind into results or one exception. It owns the policy (when to stop);
the supervisor owns the processes. Display and tracking are listeners.
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
import stat
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from . import launcher, payload
from .errors import (
    AirMagicError,
    ConfigurationError,
    DistributedTimeoutError,
    JobCancelledError,
    RunDirectoryFullError,
    SerializationError,
    WorkerDiedError,
    annotate,
    describe_returncode,
    read_error_file,
    tail_text,
)
from .events import Listener, RunContext
from .job import JobResult, JobSpec, JobStatus, RankResult, RankState
from .worker import error_path, result_path

#: Seconds between SIGTERM and SIGKILL when a job is stopped.
STOP_GRACE = 3.0
_POLL = 0.05
_READ_CHUNK = 1 << 20
#: With less free space than this under the run directory, a failed write is put down to a full disk.
DISK_FULL_BYTES = 1 << 20


def runs_root() -> Path:
    """Where run directories live: $AIR_MAGIC_RUNS_DIR, else ~/.cache/air_magic/runs (mode 0700)."""
    root = os.environ.get("AIR_MAGIC_RUNS_DIR")
    if root:
        path = Path(root)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = Path(cache) / "air_magic" / "runs"
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):  # parents too: mkdir(parents=True) would give them the umask's mode
        p.mkdir(mode=0o700, exist_ok=True)
    _check_private_root(path)
    return path


def _check_private_root(path: Path) -> None:
    """Refuse a runs directory that another user owns, or may rename our run directories in."""
    info = path.stat()
    if info.st_uid not in (os.getuid(), 0):
        raise ConfigurationError(
            f"the runs directory {path} belongs to another user (uid {info.st_uid}), who could read or replace "
            "what the workers load; set AIR_MAGIC_RUNS_DIR to a directory of your own."
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise ConfigurationError(
            f"the runs directory {path} is writable by other users without the sticky bit, so they could swap a "
            f"run directory for their own; run `chmod go-w {path}` or set AIR_MAGIC_RUNS_DIR to a private directory."
        )


def _private_file(path: Path, data: bytes = b"") -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def human_seconds(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds:g} s ({seconds / 3600:g} h)"
    return f"{seconds:g} s"


class LogTail:
    """Follows one rank's log file and yields decoded text as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read(self, final: bool = False) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(_READ_CHUNK)
        except OSError:
            return ""
        self.offset += len(data)
        return self.decoder.decode(data, final=final and len(data) < _READ_CHUNK)


class _Run:
    """State of one call between launch and result."""

    def __init__(self, spec: JobSpec, listeners: list[Listener]) -> None:
        self.spec = spec
        self.listeners = listeners
        blob = payload.serialize(spec.target, spec.args, spec.kwargs)  # fails before anything starts
        stamp = time.strftime("%Y%m%d-%H%M%S")
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in spec.name)[:40]
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"{stamp}-{safe}-", dir=runs_root()))
        self.logs = [self.run_dir / f"rank-{r}.log" for r in range(spec.world_size)]
        job = {"name": spec.name, "sys_path": list(sys.path), "cwd": os.getcwd()}
        try:
            for log in self.logs:
                _private_file(log)
            _private_file(self.run_dir / "payload.pkl", blob)
            _private_file(self.run_dir / "job.json", json.dumps(job).encode())
        except OSError as exc:  # nothing has started: leave no half-written run behind
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise AirMagicError(
                f"could not write the run directory under {self.run_dir.parent}: {exc.strerror or exc}. "
                "Free some space there, or set AIR_MAGIC_RUNS_DIR to a directory with room; nothing was started."
            ) from exc
        self.ctx = RunContext(spec, self.run_dir, self.logs)
        self.result = JobResult(
            spec, self.run_dir, [RankResult(r, log_path=self.logs[r]) for r in range(spec.world_size)]
        )
        self.tails = [LogTail(p) for p in self.logs]
        self.stop_reason: str | None = None
        self.failures: list[int] = []  # ranks in the order their exits were seen
        self.exited_at: dict[int, float] = {}  # rank -> wall time the supervisor reaped it
        self.job_id = uuid.uuid4().hex
        self.launch_error: str | None = None

    # -- listeners ---------------------------------------------------------
    def notify(self, hook: str, *args: Any) -> None:
        for listener in self.listeners:
            getattr(listener, hook)(*args)

    def enter_phase(self, phase: str) -> None:
        if self.ctx.phase != phase:
            self.ctx.phases.append((phase, self.ctx.elapsed))
            self.notify("on_phase", phase)

    def start_listeners(self) -> None:
        for listener in self.listeners:
            if listener.start_phase:
                self.enter_phase(listener.start_phase)
            listener.on_start(self.ctx)

    def set_state(self, rank: int, state: RankState) -> None:
        self.result.ranks[rank].state = state
        self.notify("on_rank_state", rank, state)

    def pump_logs(self, final: bool = False) -> None:
        for rank, tail in enumerate(self.tails):
            while True:
                text = tail.read(final)
                if text:
                    self.notify("on_output", rank, text)
                if not (final and text):  # while running, one chunk per rank per poll; at the end, all
                    break

    # -- lifecycle ---------------------------------------------------------
    def worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for listener in self.listeners:
            env.update(listener.worker_env())
        env.update(self.spec.extra_env)
        env["PYTHONUNBUFFERED"] = "1"
        env["AIR_MAGIC_RUN_DIR"] = str(self.run_dir)
        if not self.spec.uses_gpu and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.spec.world_size))
        return env

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.handle.stop(reason, STOP_GRACE)

    def on_event(self, event: dict[str, Any]) -> bool:
        """Apply one supervisor event; True when the job is over."""
        kind = event["event"]
        if self.ctx.phase == "starting the helper":
            self.enter_phase("ranks starting")  # the helper answered
        if kind == "started":
            self.result.ranks[event["rank"]].pid = event["pid"]
            self.set_state(event["rank"], RankState.RUNNING)
            if all(r.pid is not None for r in self.result.ranks):
                self.enter_phase("running")
        elif kind == "exited":
            rank, code = event["rank"], event["returncode"]
            self.result.ranks[rank].returncode = code
            self.exited_at[rank] = float(event.get("at", time.time()))
            if code == 0:
                self.set_state(rank, RankState.DONE)
            elif self.stop_reason is None or error_path(self.run_dir, rank).exists():
                self.failures.append(rank)
                self.set_state(rank, RankState.FAILED)
                self.stop(f"rank {rank} failed")
            else:
                self.set_state(rank, RankState.STOPPED)
        elif kind == "error":
            self.launch_error = event["message"]
            self.stop_reason = self.stop_reason or "launch failed"
        elif kind in ("finished", "supervisor-died"):
            if kind == "supervisor-died":
                code = event.get("returncode")
                how = "" if code is None else f" ({describe_returncode(code)})"
                self.launch_error = f"air_magic's supervisor process died{how}; its log: {event.get('log')}"
            return True
        return False

    def wait(self) -> str:
        deadline = None if self.spec.timeout is None else self.ctx.started_at + self.spec.timeout
        while True:
            event = self.handle.next_event(_POLL)
            while event is not None:
                if event["event"] == "stale":
                    return "stale"
                if self.on_event(event):
                    return "finished"
                event = self.handle.next_event(0)
            self.pump_logs()
            self.notify("poll")
            if self.ctx.cancelled:
                self.stop("cancelled")
            if deadline is not None and time.monotonic() > deadline:
                self.stop("timeout")

    def wait_stopped(self) -> None:
        """After Ctrl-C: wait for the supervisor to confirm every process is gone."""
        limit = time.monotonic() + STOP_GRACE + 10
        while time.monotonic() < limit:
            try:
                event = self.handle.next_event(_POLL)
                if event is not None and self.on_event(event):
                    return
            except KeyboardInterrupt:  # a second Ctrl-C: keep cleaning up
                continue

    def execute(self) -> JobResult:
        fresh = launcher._client is None or not launcher._client.alive
        client = launcher.supervisor(runs_root())  # a new one starts (imports torch) while listeners start
        self.start_listeners()
        self.enter_phase("starting the helper" if fresh else "ranks starting")
        warm = launcher.warm_default() if self.spec.warm is None else self.spec.warm
        request = {
            "mode": "fork" if warm else "spawn",
            "sys_path": list(sys.path),
            "world_size": self.spec.world_size,
            "executable": sys.executable,
            "run_dir": str(self.run_dir),
            "logs": [str(p) for p in self.logs],
            "env": self.worker_env(),
            "package_parent": str(Path(__file__).resolve().parent.parent),
        }
        try:
            self.handle = client.launch(self.job_id, request)
            try:
                if self.wait() == "stale":  # the warm supervisor no longer matches: use a fresh one
                    client.forget(self.job_id)
                    client = launcher.supervisor(runs_root(), replace=client)
                    self.enter_phase("starting the helper")
                    self.handle = client.launch(self.job_id, request)
                    self.wait()
            except KeyboardInterrupt:
                self.stop("interrupted")
                self.wait_stopped()
                self.finish()
                raise
            return self.finish()
        finally:
            client.forget(self.job_id)

    # -- outcome -----------------------------------------------------------
    def finish(self) -> JobResult:
        self.pump_logs(final=True)
        self.result.elapsed = self.ctx.elapsed
        for rank in self.result.ranks:
            if rank.state in (RankState.PENDING, RankState.RUNNING):
                rank.state = RankState.STOPPED
        error = self.outcome_error()
        if error is None:
            self.result.status = JobStatus.FINISHED
        elif self.stop_reason in ("interrupted", "cancelled", "timeout"):
            self.result.status = JobStatus.KILLED
        else:
            self.result.status = JobStatus.FAILED
        self.result.error = error
        self.notify("on_end", self.result)
        return self.result

    def failed_at(self, rank: int) -> float:
        """When a rank failed: when it wrote its error record, else when its exit was reaped."""
        when = self.exited_at.get(rank, float("inf"))
        try:
            return min(when, error_path(self.run_dir, rank).stat().st_mtime_ns / 1e9)
        except OSError:
            return when

    def rank_error(self, rank: int) -> BaseException:
        exc = read_error_file(error_path(self.run_dir, rank), rank)
        log = self.logs[rank]
        if exc is not None:
            return annotate(exc, f"raised on rank {rank} of {self.spec.world_size}; its full log: {log}")
        code = self.result.ranks[rank].returncode or 0
        return WorkerDiedError(
            f"rank {rank} {describe_returncode(code)} without a Python exception. "
            f"Last lines of its output:\n{tail_text(log) or '(no output)'}\nFull log: {log}"
        )

    def disk_full_error(self) -> BaseException | None:
        """A rank failed or left no result while the run directory's disk is full: say so, not just 'exit 1'."""
        try:
            free = shutil.disk_usage(self.run_dir).free
        except OSError:
            return None
        if free >= DISK_FULL_BYTES or not (self.failures or self.launch_error or self.missing_results()):
            return None
        ranks = ", ".join(map(str, self.failures or self.missing_results()))
        error = RunDirectoryFullError(
            f"the disk holding the run directory {self.run_dir} is full ({free:,} bytes free), so rank(s) {ranks} "
            "could not write their output, result or error; every worker was stopped. Free some space there, "
            "or set AIR_MAGIC_RUNS_DIR to a directory on a disk with room. What the ranks wrote before is kept there."
        )
        if self.failures:
            error.__cause__ = self.rank_error(min(self.failures, key=self.failed_at))
        return error

    def missing_results(self) -> list[int]:
        return [r.rank for r in self.result.ranks if not result_path(self.run_dir, r.rank).exists()]

    def outcome_error(self) -> BaseException | None:
        where = f"Logs of every rank are in {self.run_dir}."
        if self.stop_reason == "interrupted":
            return KeyboardInterrupt()
        if self.stop_reason == "timeout":
            return DistributedTimeoutError(
                f"{self.spec.name} ran longer than its timeout of {human_seconds(self.spec.timeout or 0)} "
                f"and every worker was stopped. Pass a larger timeout=... (seconds, or None for no limit) "
                f"to distributed(...), or --timeout S to %%distributed. {where}"
            )
        if self.stop_reason == "cancelled":
            return JobCancelledError(f"{self.spec.name} was cancelled; every worker was stopped. {where}")
        full = self.disk_full_error()
        if full is not None:
            return full
        if self.failures:
            # The rank that failed first is the cause; peers that lost it fail a moment later (gloo's
            # "Connection closed by peer") and may even exit sooner, so order by when each failed.
            ranks = sorted(self.failures, key=self.failed_at)
            first = self.rank_error(ranks[0])
            others = [f"rank {r}: {self.rank_error(r)!r}".splitlines()[0] for r in ranks[1:]]
            if others:
                annotate(first, "other ranks that failed too: " + "; ".join(others))
            if self.launch_error:
                annotate(first, f"air_magic: {self.launch_error}")
            return first
        if self.launch_error:
            return AirMagicError(f"air_magic could not run the job: {self.launch_error}. {where}")
        for rank in self.result.ranks:
            path = result_path(self.run_dir, rank.rank)
            if not path.exists():
                return AirMagicError(f"rank {rank.rank} ended without leaving a result. {where}")
            import cloudpickle

            try:
                rank.value = cloudpickle.loads(path.read_bytes())
            except Exception as exc:  # noqa: BLE001 - it pickled there but does not rebuild here
                error = SerializationError(
                    f"the return value of rank {rank.rank} could not be rebuilt in this process: "
                    f"{type(exc).__name__}: {exc}. Return plain data (numbers, lists, dicts, tensors moved to CPU) "
                    f"whose types this notebook can import. It is kept in {path}."
                )
                error.__cause__ = exc
                return error
        return None


def default_listeners(spec: JobSpec) -> list[Listener]:
    """Tracking first (it makes the run link), then the display that shows it."""
    from .display import make_display

    listeners: list[Listener] = []
    if spec.mlflow:
        from .tracking import make_tracker

        tracker = make_tracker(spec)
        if tracker is not None:
            listeners.append(tracker)
    listeners.append(make_display(spec))
    return listeners


def run(spec: JobSpec, listeners: list[Listener] | None = None) -> JobResult:
    """Run `spec` on its workers and return every rank's result, or raise the first failure."""
    chosen = default_listeners(spec) if listeners is None else listeners
    result = _Run(spec, chosen).execute()
    if result.error is not None:
        raise result.error
    return result
