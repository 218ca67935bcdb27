"""What an attempt's ranks left, turned into the call's outcome: return values, or the one error to raise.

The runner (runner.py) decides when to start, stop and restart; this module
only reads what an attempt left behind (each rank's `RankOutcome`, exit code
and log, how the runner stopped it) and says what the call returns or raises:
the first failing rank's own exception with the other failures noted, a
`WorkerDiedError` with the tail of a rank's log, a timeout or cancel naming
where each rank was (launch/files/stack_dumps.py), a full disk said as such, or
every rank's return value rebuilt here with a warning for large ones.
`AttemptOutcome` is the runner's base class: it holds no state of its own.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from .envvars import LARGE_RESULT_MIB as LARGE_RESULT_MIB_ENV
from .envvars import RUNS_DIR
from .errors import (
    AirMagicError,
    DistributedTimeoutError,
    JobCancelledError,
    ResultSizeWarning,
    RunDirectoryFullError,
    SerializationError,
    WorkerDiedError,
    annotate,
    describe_returncode,
    tail_text,
)
from .job import JobResult, JobSpec, StopReason
from .launch import protocol as p
from .launch.files.rundir import RunDir
from .launch.files.stack_dumps import where_ranks_were
from .payload import _user_stacklevel as user_stacklevel

#: Characters of an earlier attempt's failure kept in the note of the call's error.
FAILURE_LINE_CHARS = 300
#: With less free space than this under the run directory, a failed write is put down to a full disk.
DISK_FULL_BYTES = 1 << 20
#: A rank's pickled return value above this many MiB gets a ResultSizeWarning; $AIR_MAGIC_LARGE_RESULT_MIB overrides.
LARGE_RESULT_MIB = 256


def human_seconds(seconds: float) -> str:
    """`10800` -> '10800 s (3 h)': how a timeout is said in its error."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds:g} s ({seconds / 3600:g} h)"
    return f"{seconds:g} s"


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, bounded: how an earlier attempt's failure is listed."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= FAILURE_LINE_CHARS else text[: FAILURE_LINE_CHARS - 1] + "…"


class AttemptOutcome:
    """The judging half of a call: reads the attempt state the runner keeps, never changes a rank."""

    spec: JobSpec
    run_dir: RunDir
    logs: list[Path]
    result: JobResult
    attempt: int
    outcomes: dict[int, p.RankOutcome]
    stop_reason: StopReason | None
    failures: list[int]
    exited_at: dict[int, float]
    launch_error: str | None

    def first_failure(self, error: BaseException) -> str:
        """One line for how this attempt ended: its first failed rank and what it raised or how it died."""
        if not self.failures:
            return one_line(AirMagicError(self.launch_error)) if self.launch_error else one_line(error)
        rank = min(self.failures, key=self.failed_at)
        raised = self.outcomes.get(rank, p.RankOutcome()).error
        if raised is None:
            return f"rank {rank} {describe_returncode(self.result.ranks[rank].returncode or 0)}"
        text = one_line(raised)
        head = f"{type(raised).__name__}: rank {rank} "
        return text[len(type(raised).__name__) + 2 :] if text.startswith(head) else f"rank {rank} raised {text}"

    def earlier_note(self) -> str:
        """What each earlier attempt's first failure was: the note under the last attempt's error."""
        lines = [f"  attempt {n + 1}: {why}" for n, why in enumerate(self.result.earlier_failures)]
        return (
            f"air_magic started every rank again {len(lines)} time(s) (max_restarts={self.spec.max_restarts}); "
            f"this is attempt {self.attempt + 1}. The earlier attempts ended with:\n" + "\n".join(lines)
        )

    def failed_at(self, rank: int) -> float:
        """When a rank failed: when it recorded its error, else when its exit was seen."""
        when = self.exited_at.get(rank, float("inf"))
        recorded = self.outcomes[rank].error_at if rank in self.outcomes else None
        return when if recorded is None else min(when, recorded)

    def rank_error(self, rank: int) -> BaseException:
        outcome = self.outcomes.get(rank)
        log = self.logs[rank]
        if outcome is not None and outcome.error is not None:
            return annotate(outcome.error, f"raised on rank {rank} of {self.spec.world_size}; its full log: {log}")
        code = self.result.ranks[rank].returncode or 0
        return WorkerDiedError(
            f"rank {rank} {describe_returncode(code)} without a Python exception. "
            f"Last lines of its output:\n{tail_text(log) or '(no output)'}\nFull log: {log}"
        )

    def missing_results(self) -> list[int]:
        return [r.rank for r in self.result.ranks if self.outcomes.get(r.rank, p.RankOutcome()).value is None]

    def disk_full_error(self) -> BaseException | None:
        """A rank failed or left no result while the run directory's disk is full: say so, not just 'exit 1'."""
        try:
            free = shutil.disk_usage(self.run_dir.path).free
        except OSError:
            return None
        if free >= DISK_FULL_BYTES or not (self.failures or self.launch_error or self.missing_results()):
            return None
        ranks = ", ".join(map(str, self.failures or self.missing_results()))
        error = RunDirectoryFullError(
            f"the disk holding the run directory {self.run_dir.path} is full ({free:,} bytes free), so rank(s) "
            f"{ranks} could not write their output, result or error; every worker was stopped. Free some space "
            f"there, or set {RUNS_DIR} to a directory on a disk with room. What the ranks wrote before is "
            "kept there."
        )
        if self.failures:
            error.__cause__ = self.rank_error(min(self.failures, key=self.failed_at))
        return error

    def outcome_error(self) -> BaseException | None:
        where = f"Logs of every rank are in {self.run_dir.path}."
        stopped = self.stop_reason is not None and self.stop_reason.by_caller
        stacks = where_ranks_were(self.logs) if stopped else None  # what each rank wrote as it was stopped
        if stacks:
            where = f"{where}\n{stacks}"
        if self.stop_reason == StopReason.INTERRUPTED:
            return annotate(KeyboardInterrupt(), stacks) if stacks else KeyboardInterrupt()
        if self.stop_reason == StopReason.TIMEOUT:
            return DistributedTimeoutError(
                f"{self.spec.name} ran longer than its timeout of {human_seconds(self.spec.timeout or 0)} "
                f"and every worker was stopped. Pass a larger timeout=... (seconds, or None for no limit) "
                f"to distributed(...), or --timeout S to %%distributed. {where}"
            )
        if self.stop_reason == StopReason.CANCELLED:
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
        return self.rebuild_results()

    def rebuild_results(self) -> BaseException | None:
        """Unpickle every rank's return value into the result; warn about large ones; an error naming the ranks."""
        import cloudpickle

        where = f"Logs of every rank are in {self.run_dir.path}."
        for rank in self.result.ranks:
            if self.outcomes.get(rank.rank, p.RankOutcome()).value is None:
                return AirMagicError(f"rank {rank.rank} ended without leaving a result. {where}")
        self.warn_large_results()
        failed: dict[int, Exception] = {}
        for rank in self.result.ranks:
            try:
                rank.value = cloudpickle.loads(self.outcomes[rank.rank].value or b"")
            except Exception as exc:  # noqa: BLE001 - it pickled there but does not rebuild here
                failed[rank.rank] = exc
        if not failed:
            return None
        first = min(failed)
        cause = failed[first]
        reason = f"{type(cause).__name__}: {cause}".rstrip(". ")
        whose = f"the return value of rank {first}"
        if len(failed) > 1:
            whose, reason = f"the return values of ranks {', '.join(map(str, failed))}", f"rank {first}: {reason}"
        error = SerializationError(
            f"{whose} could not be rebuilt in this process ({reason}); return plain data "
            "(numbers, lists, dicts, tensors) whose types this notebook can import, such as a model's "
            f"state_dict() rather than the model. Rank {first}'s log: {self.logs[first]}"
        )
        error.__cause__ = cause
        return error

    def warn_large_results(self) -> None:
        """A ResultSizeWarning naming each rank whose pickled return value is over the limit, and what to do instead."""
        try:
            limit = float(os.environ.get(LARGE_RESULT_MIB_ENV, LARGE_RESULT_MIB)) * 2**20
        except ValueError:
            limit = LARGE_RESULT_MIB * 2**20
        sizes = {r: len(o.value) for r, o in sorted(self.outcomes.items()) if o.value is not None}
        large = {r: n for r, n in sizes.items() if n > limit}
        if not large:
            return
        which = ", ".join(f"rank {r} returned {n / 2**20:,.0f} MiB" for r, n in large.items())
        warnings.warn(
            f"{self.spec.name}: {which} (pickled), and all of it is copied into this notebook's memory. "
            "Return large values from rank 0 only (`return model.state_dict() if rank == 0 else None`), or save a "
            "checkpoint to a file inside the function and return its path. (Warns above "
            f"{limit / 2**20:g} MiB per rank; set {LARGE_RESULT_MIB_ENV} to change that.)",
            ResultSizeWarning,
            stacklevel=user_stacklevel(),
        )
