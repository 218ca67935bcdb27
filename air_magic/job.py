"""The job description both front doors build, and what the runner hands back.

`JobSpec` is everything the runner needs to start a call; `JobResult` is what
came back, keyed by rank. These are plain dataclasses: no process, widget or
tracking logic lives here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .profiling.profile import Profile


class RankState(str, enum.Enum):
    """Lifecycle of one rank as the display shows it."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"


class StopReason(str, enum.Enum):
    """Why the runner stopped the ranks of an attempt; the value is the word the launcher is told."""

    RANK_FAILED = "a rank failed"
    LAUNCH_FAILED = "launch failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"
    TIMEOUT = "timeout"

    @property
    def by_caller(self) -> bool:
        """The user (Cancel, Ctrl-C) or the time limit ended the call: it ends KILLED and is never restarted."""
        return self in (StopReason.CANCELLED, StopReason.INTERRUPTED, StopReason.TIMEOUT)


class JobStatus(str, enum.Enum):
    """How a call ended; the names are MLflow's run statuses."""

    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"


class CallStatus:
    """A call's status, as its handle, its record (`call.json`) and every reader say it: the one list of them."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    #: The statuses of a call that has not ended.
    LIVE = (WAITING, RUNNING)

    @staticmethod
    def of(result: JobResult | None, error: BaseException | None) -> str:
        """How a call ended: finished when its result says so and nothing was raised; cancelled when it was."""
        from .errors import JobCancelledError

        if result is not None and result.status == JobStatus.FINISHED and error is None:
            return CallStatus.FINISHED
        return CallStatus.CANCELLED if isinstance(error, JobCancelledError) else CallStatus.FAILED


@dataclass(frozen=True)
class Alert:
    """What the watch of a call saw (docs/watching.md): a straggling rank, a hung one, or a fatal line of a rank's
    output (out of memory, NCCL, CUDA, Xid, segfault, ...: watching/fatal_lines.py)."""

    #: "straggler", "hang", or a fatal line's kind: "oom", "nccl", "cuda", "xid", "segfault", "killed", "store", ...
    kind: str
    rank: int
    #: A straggler's: "input" or "compute"; a hang's: "no progress"; a fatal line's: "output".
    cause: str
    #: The line the call's output and panel show.
    message: str
    #: When it was raised (time.time()).
    time: float
    #: A straggler's lag per step, a hang's seconds without progress.
    seconds: float = 0.0


#: What `on_hang=` may say: report the hang and go on, stop the call, or start its world again (max_restarts).
ON_HANG = ("report", "stop", "restart")


@dataclass(frozen=True)
class JobSpec:
    """What to run and where: built by a front door, consumed by the runner."""

    target: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    name: str
    world_size: int
    accelerator_type: str
    timeout: float | None
    mlflow: bool = True
    warm: bool | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Which front door built it: "function" (@distributed) or "cell" (%%distributed).
    origin: str = "function"
    #: Hot ranks: seconds the ranks stay alive after the call for the next one of the same world.
    keep_alive: float | None = None
    #: Machines the ranks are spread over; `world_size` counts every rank of every node.
    num_nodes: int = 1
    #: Times the whole world may start again after a rank fails (raises, dies, is killed, loses its node).
    max_restarts: int = 0
    #: A session's name: the call runs in that session's hot ranks and namespace (launch/rank/session.py).
    session: str | None = None
    #: The ranks of the session that run the call; None: every rank.
    ranks: tuple[int, ...] | None = None
    #: The call is watched for stragglers and hangs (watching/); `on_hang`: what a hang leads to (ON_HANG).
    watch: bool = True
    on_hang: str = "report"
    #: Steps of every rank to profile with torch.profiler (profiling/); None: none.
    profile: int | None = None
    #: GPU ranks keep CUDA's allocation history, for the snapshot an out-of-memory error writes.
    memory_history: bool = False

    @property
    def uses_gpu(self) -> bool:
        return self.accelerator_type.upper().startswith("GPU")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.num_nodes


@dataclass
class RankResult:
    """One rank's outcome: its return value, or why it did not return."""

    rank: int
    state: RankState = RankState.PENDING
    value: Any = None
    returncode: int | None = None
    pid: int | None = None
    #: The address of the machine the rank ran on, where the launcher said (Ray); "": this one.
    host: str = ""
    log_path: Path | None = None
    #: Wall time (time.time()) the launcher saw the rank's process end.
    exited_at: float | None = None
    #: A GPU rank's peak allocated CUDA memory of the call, in bytes (torch.cuda.max_memory_allocated), if it used CUDA.
    gpu_peak_allocated: int | None = None


@dataclass
class JobResult:
    """All ranks of one call, indexed by global rank, plus how the call ended."""

    spec: JobSpec
    run_dir: Path
    ranks: list[RankResult]
    status: JobStatus = JobStatus.FINISHED
    error: BaseException | None = None
    elapsed: float = 0.0
    #: Attempts that ran: 1, plus one per restart; `ranks` are the last attempt's.
    attempts: int = 1
    #: How each earlier attempt ended (its first failure), one line each, oldest first.
    earlier_failures: list[str] = field(default_factory=list)
    #: A session's call: what each rank that answered holds (name -> "type, size"), and why its ranks ended,
    #: if they did during the call (None: the session is kept, in the last attempt's ranks).
    session_names: dict[int, dict[str, str]] = field(default_factory=dict)
    session_end: str | None = None
    #: A session's call that restarted (max_restarts): why; the ranks from before, and what they held, are gone.
    session_restarted: str | None = None
    #: What the watch saw: stragglers and hangs, oldest first (docs/watching.md).
    alerts: list[Alert] = field(default_factory=list)
    #: What profiling `spec.profile` steps of every rank found (docs/profiling.md); None when not profiled.
    profile: Profile | None = None

    @property
    def values(self) -> list[Any]:
        """Return values as a list indexed by global rank (only the ranks that ran, for a session's `ranks`)."""
        return [r.value for r in self.ranks if self.spec.ranks is None or r.rank in self.spec.ranks]

    def raise_for_status(self) -> JobResult:
        """Raise the call's exception if it did not finish; else return self (what the front doors do)."""
        if self.error is not None:
            raise self.error
        return self
