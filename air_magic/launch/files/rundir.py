"""The run directory: where each call's record lives on this machine, and the privacy rules for it.

This is the only module that builds paths inside the runs root. A call's directory (mode 0700) holds, per rank,
its log (`rank-N.log`, the loss-free record of everything it wrote), its pickled result and its error record,
plus the call's payload and job description. Files are 0600 and never follow a name another user could plant.

A call that restarts (max_restarts) runs every attempt in the same directory:
each log goes on after a marker line (`attempt_marker`), and what the earlier
attempt left (results, error records, payload, job description) is moved to
`attempt-N/` so that it is never read as the new attempt's (`begin_attempt`).

Room for each rank's error record is set aside when the directory is made
(`rank-N.error.reserved`): a rank that fails because the disk filled up can
still say why, and a disk already full stops the call before anything starts.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ...envvars import RUNS_DIR
from ...errors import AirMagicError, ConfigurationError
from . import scratch

#: Bytes set aside per rank for its error record: room for a long traceback.
ERROR_RESERVE = 64 << 10


def runs_root() -> Path:
    """Where run directories live: $AIR_MAGIC_RUNS_DIR, else ~/.cache/air_magic/runs (mode 0700)."""
    root = os.environ.get(RUNS_DIR)
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
            f"what the workers load; set {RUNS_DIR} to a directory of your own."
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise ConfigurationError(
            f"the runs directory {path} is writable by other users without the sticky bit, so they could swap a "
            f"run directory for their own; run `chmod go-w {path}` or set {RUNS_DIR} to a private directory."
        )


def write_private(path: Path, data: bytes, exclusive: bool = True) -> None:
    """Write `data` to a new file of mode 0600 (`exclusive`: fail if the name exists)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def attempt_marker(attempt: int, allowed: int, why: str) -> str:
    """The line that starts attempt `attempt` (from 0, of `allowed`) in every rank's log; `why` the last one ended."""
    return f"===== air_magic: attempt {attempt + 1} of {allowed}; every rank starts again after: {why} =====\n"


def helper_log(kind: str, *tags: object) -> Path:
    """The log of a per-kernel helper process (`supervisor`, `mlflow-ui`), in the runs root."""
    return runs_root() / ("-".join([kind, *map(str, tags)]) + ".log")


@dataclass(frozen=True)
class RunDir:
    """One call's directory and the names inside it."""

    path: Path

    @classmethod
    def create(cls, name: str, world_size: int) -> RunDir:
        """A new private directory under the runs root, with an empty log and room for an error record per rank."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40]
        root = runs_root()
        run = cls(Path(tempfile.mkdtemp(prefix=f"{stamp}-{safe}-", dir=root)))
        try:
            for rank in range(world_size):
                write_private(run.log(rank), b"")
                run.reserve_error_record(rank)
        except OSError as exc:  # nothing has started: leave no half-made run behind
            run.remove()
            raise run.write_failed(exc) from exc
        return run

    @classmethod
    def scratch(cls, name: str) -> RunDir:
        """A Ray rank's private directory in this machine's temporary one, held till `remove()` (scratch.py)."""
        return cls(scratch.make(name))

    def write_failed(self, exc: OSError) -> AirMagicError:
        return AirMagicError(
            f"could not write the run directory under {self.path.parent}: {exc.strerror or exc}. "
            f"Free some space there, or set {RUNS_DIR} to a directory with room; nothing was started."
        )

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        scratch.release(self.path)

    def log(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.log"

    def logs(self, world_size: int) -> list[Path]:
        return [self.log(r) for r in range(world_size)]

    def result(self, rank: int) -> Path:
        return self.path / f"rank-{rank}.result.pkl"

    def error(self, rank: int) -> Path:
        """The rank's error record (JSON: type, message, traceback)."""
        return self.path / f"rank-{rank}.error.json"

    def error_reserve(self, rank: int) -> Path:
        """Space set aside for the rank's error record; the record is written into it, then renamed."""
        return self.path / f"rank-{rank}.error.reserved"

    def reserve_error_record(self, rank: int) -> None:
        """Set aside room for the rank's error record (zeros written, so the disk's blocks are really taken)."""
        write_private(self.error_reserve(rank), bytes(ERROR_RESERVE))

    def release_reserves(self) -> None:
        """Give back the room set aside for error records no rank used (it returned, was stopped, ran elsewhere)."""
        for reserve in self.path.glob("rank-*.error.reserved"):
            reserve.unlink(missing_ok=True)

    def attempt(self, attempt: int) -> Path:
        """Where what attempt `attempt` (from 0) left is kept once a later attempt starts."""
        return self.path / f"attempt-{attempt}"

    def begin_attempt(self, attempt: int, world_size: int, marker: str) -> None:
        """Make the directory ready for attempt `attempt` (1 or more) of the same call.

        The last attempt's results, error records, payload and job description move to `attempt(attempt - 1)`,
        room for each rank's error record is set aside again, and each log gets `marker` on a line of its own.
        """
        kept = self.attempt(attempt - 1)
        try:
            kept.mkdir(mode=0o700)
            for rank in range(world_size):
                for path in (self.result(rank), self.error(rank), self.error_pickle(rank)):
                    if path.exists():
                        path.rename(kept / path.name)
                self.error_reserve(rank).unlink(missing_ok=True)
                self.reserve_error_record(rank)
                with open(self.log(rank), "ab+") as log:
                    ends_mid_line = (
                        log.seek(0, os.SEEK_END) > 0 and log.seek(-1, os.SEEK_END) >= 0 and log.read(1) != b"\n"
                    )
                    log.write((b"\n" if ends_mid_line else b"") + marker.encode())
            for path in (self.payload, self.job):
                if path.exists():
                    path.rename(kept / path.name)
        except OSError as exc:
            raise AirMagicError(
                f"could not make the run directory {self.path} ready for attempt {attempt + 1}: "
                f"{exc.strerror or exc}; the call was not started again."
            ) from exc

    def error_pickle(self, rank: int) -> Path:
        """The rank's exception itself, when it pickles."""
        return self.path / f"rank-{rank}.error.pkl"

    def metrics(self, rank: int) -> Path:
        """What the rank logged to MLflow, as JSON lines, when it cannot reach the store itself (tracking/relay.py)."""
        return self.path / f"rank-{rank}.mlflow.jsonl"

    def chart_metrics(self, rank: int) -> Path:
        """Every metric value the rank logged, as JSON lines, for the live charts (tracking/tee.py)."""
        return self.path / f"rank-{rank}.metrics.jsonl"

    def usage(self, rank: int) -> Path:
        """What a rank on another node uses, as sampled there and last received (rank_files.py)."""
        return self.path / f"rank-{rank}.usage"

    def steps(self, rank: int) -> Path:
        """The rank's step times and state now, rewritten about once a second while it is watched (step_times.py)."""
        return self.path / f"rank-{rank}.steps.json"

    def trace(self, rank: int, number: int = 0) -> Path:
        """The rank's torch.profiler trace (Chrome JSON): of `profile=N` (0), or of the `number`th handle.profile()."""
        return self.path / (f"rank-{rank}.trace.json" if not number else f"rank-{rank}.trace-{number}.json")

    def profile_window(self, rank: int, number: int = 0) -> Path:
        """Which steps the rank profiled, on which thread and host (profile_windows.py); `number` as `trace`'s."""
        return self.path / (f"rank-{rank}.profile.json" if not number else f"rank-{rank}.profile-{number}.json")

    def profile_summary(self, number: int = 0) -> Path:
        """What profile `number` (as `trace`'s) found, as JSON (`Profile.record`), for the call's record."""
        return self.path / ("profile.summary.json" if not number else f"profile-{number}.summary.json")

    def profile_summaries(self) -> list[Path]:
        """Every profile summary of the call, `profile=N`'s first, then `handle.profile()`'s in their order."""
        numbered = sorted(self.path.glob("profile-*.summary.json"), key=lambda p: int(p.name.split(".")[0][8:]))
        return [p for p in [self.profile_summary()] if p.exists()] + numbered

    def merged(self, number: int = 0) -> Path:
        """Every rank's trace in one file, a process per rank, clocks aligned (profiling/merge.py)."""
        return self.path / ("profile.trace.json" if not number else f"profile-{number}.trace.json")

    @property
    def merged_trace(self) -> Path:
        """The merged trace of `profile=N`."""
        return self.merged(0)

    @property
    def profile_request(self) -> Path:
        """`handle.profile(steps)` of a running call: its number and steps, which the ranks' watch reads
        (profile_windows.py)."""
        return self.path / "profile.request"

    def memory_snapshot(self, rank: int) -> Path:
        """The rank's CUDA memory snapshot, written when it ran out of memory (PyTorch's memory viewer reads it)."""
        return self.path / f"rank-{rank}.memory.pickle"

    def carried_back(self, rank: int) -> list[Path]:
        """A remote rank's files that come back with its result: profile=N's, its memory report and OOM snapshot."""
        return [self.trace(rank), self.profile_window(rank), self.memory(rank), self.memory_snapshot(rank)]

    def memory(self, rank: int) -> Path:
        """What the rank's CUDA allocator says at the call's end: peak allocated bytes (memory_report.py)."""
        return self.path / f"rank-{rank}.memory.json"

    def debug_wait(self, rank: int) -> Path:
        """The rank's debugger waits for an answer: its output and prompt, as JSON (debug_channel.py)."""
        return self.path / f"debug-{rank}.wait"

    def debug_answers(self, rank: int) -> Path:
        """The FIFO on which the rank's debugger reads each answer, one line (debug_channel.py)."""
        return self.path / f"debug-{rank}.answers"

    #: The file a Stop leaves (stopping.py): the ranks' `should_stop()` is True once it exists.
    STOP_FLAG = "stop"

    @property
    def stop_flag(self) -> Path:
        return self.path / self.STOP_FLAG

    def request_stop(self) -> bool:
        """Leave the Stop flag (its content: when, for people); False if it was there already."""
        try:
            write_private(self.stop_flag, f"{time.time():.3f}\n".encode())
        except FileExistsError:
            return False
        return True

    @property
    def cancel_flag(self) -> Path:
        """The file another process of this user leaves to cancel the call (calls/record.py); its owner polls for it."""
        return self.path / "cancel"

    @property
    def owner_lock(self) -> Path:
        """The lock its owner process holds while the call is live (calls/record.py): free once that process is gone."""
        return self.path / "owner.lock"

    @property
    def owner_log(self) -> Path:
        """A detached call's owner process writes its own output here (calls/detached.py)."""
        return self.path / "owner.log"

    @property
    def detached_call(self) -> Path:
        """What a detached call's owner process runs: the call and its settings, pickled (calls/detached.py)."""
        return self.path / "detached.pkl"

    @property
    def flight_recorder(self) -> Path:
        """Where NCCL's flight recorder writes each rank's dump, and keeps the pipe that asks for one
        (launch/files/flight_recorder.py)."""
        return self.path / "flight_recorder"

    @property
    def payload(self) -> Path:
        return self.path / "payload.pkl"

    @property
    def job(self) -> Path:
        """The job description a worker reads: name, sys.path, cwd, hooks."""
        return self.path / "job.json"
