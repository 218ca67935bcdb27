"""What an attempt's ranks left, turned into the call's outcome: return values, or the one error to raise.

The runner (runner.py) decides when to start, stop and restart; this module
only reads what an attempt left behind (each rank's `RankOutcome`, exit code
and log, how the runner stopped it) and says what the call returns or raises:
the root cause's own exception with the other failures noted after it, a
`WorkerDiedError` with the tail of a rank's log, a timeout or cancel naming
where each rank was (launch/files/stack_dumps.py), a full disk said as such, or
every rank's return value rebuilt here with a warning for large ones.
`AttemptOutcome` is the runner's base class: it holds no state of its own.

The root cause is judged from what each failed rank left, not from which end
was seen first (torch elastic takes the first failure in time; here a rank
SIGKILLed is often reaped after its peer's gloo "Connection reset by peer" was
written): a rank that died (a signal, an exit without an exception) or raised
in its own code comes before a rank whose error was raised inside
torch.distributed, which a peer's end causes. `stop_grace` lets the runner
wait a moment for the others' ends while every failure seen is of that kind.
"""

from __future__ import annotations

import enum
import os
import re
import shutil
import warnings
from pathlib import Path

from ..envvars import LARGE_RESULT_MIB as LARGE_RESULT_MIB_ENV
from ..envvars import RUNS_DIR
from ..errors import (
    AirMagicError,
    DistributedTimeoutError,
    JobCancelledError,
    ResultSizeWarning,
    RunDirectoryFullError,
    SerializationError,
    WorkerDiedError,
    annotate,
    describe_returncode,
)
from ..job import JobResult, JobSpec, StopReason
from ..launch import protocol as p
from ..launch.files.rundir import RunDir
from ..launch.files.stack_dumps import death_tail, where_ranks_were
from ..payload import _user_stacklevel as user_stacklevel

#: Characters of an earlier attempt's failure kept in the note of the call's error.
FAILURE_LINE_CHARS = 300
#: With less free space than this under the run directory, a failed write is put down to a full disk.
DISK_FULL_BYTES = 1 << 20
#: After a rank's error raised inside a collective, how long its peers' ends are awaited before they are stopped:
#: the peer whose death caused it (SIGKILL, the OOM killer) is reaped a moment after.
PEER_GRACE = 2.0
#: A rank's pickled return value above this many MiB gets a ResultSizeWarning; $AIR_MAGIC_LARGE_RESULT_MIB overrides.
LARGE_RESULT_MIB = 256


class Blame(enum.IntEnum):
    """How likely a failed rank is the cause of its attempt's end, most likely first."""

    #: It died (a signal, an exit without an exception) or raised in its own code.
    CAUSE = 0
    #: It raised inside torch.distributed: a peer's end is the likely cause (gloo's "Connection reset by peer").
    COLLECTIVE = 1


#: The file of a frame inside torch.distributed, as a formatted traceback names it.
_DISTRIBUTED_FRAME = re.compile(r'File "[^"]*[/\\]torch[/\\]distributed[/\\][^"]*"')
_ANY_FRAME = re.compile(r'File "[^"]*"')
#: What collectives say when a peer went away, for an error whose traceback did not come back.
_PEER_GONE = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|NCCL (communicator|error)|ProcessGroupNCCL|"
    r"ProcessGroupGloo|DistBackendError|DistNetworkError|Socket Timeout|Timed out waiting",
    re.IGNORECASE,
)


def raised_in_collective(error: BaseException) -> bool:
    """The error came from inside torch.distributed: its type is torch's, or its innermost frame is there (the
    rank's formatted traceback is its `__cause__`), or, with no traceback, its message is a collective's."""
    if type(error).__module__.startswith("torch.distributed"):
        return True
    text = getattr(error.__cause__, "text", None)
    if isinstance(text, str):
        frames = _ANY_FRAME.findall(text)
        return bool(frames) and _DISTRIBUTED_FRAME.fullmatch(frames[-1]) is not None
    return _PEER_GONE.search(str(error)) is not None


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
        rank = self.root_cause()
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

    def blame(self, rank: int) -> Blame:
        """What a failed rank left says of it: the cause, or a collective that a peer's end broke."""
        raised = self.outcomes.get(rank, p.RankOutcome()).error
        return Blame.COLLECTIVE if raised is not None and raised_in_collective(raised) else Blame.CAUSE

    def by_blame(self) -> list[int]:
        """The failed ranks, root cause first: a death or a user error before a collective's error, then by time."""
        return sorted(self.failures, key=lambda rank: (self.blame(rank), self.failed_at(rank)))

    def root_cause(self) -> int:
        return self.by_blame()[0]

    def stop_grace(self) -> float:
        """After a failure: how long to let the other ranks end by themselves before they are stopped. While every
        failure is a collective's error, PEER_GRACE (its cause may be a peer whose end is not seen yet); else 0."""
        only_collectives = all(self.blame(rank) == Blame.COLLECTIVE for rank in self.failures)
        return PEER_GRACE if self.failures and only_collectives else 0.0

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
            f"Last lines of its output:\n{death_tail(log) or '(no output)'}\nFull log: {log}"
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
            error.__cause__ = self.rank_error(self.root_cause())
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
            # A death or a user error is the cause; peers that lost that rank fail inside a collective (gloo's
            # "Connection closed by peer"), and may be seen sooner, so they come after it whatever the times.
            ranks = self.by_blame()
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
