"""The typed messages of the process boundary: what the runner asks of a launcher, and what it hears back.

Every request and event that crosses the boundary is a dataclass defined here,
and nowhere else is an event named by a string. The local launcher also
sends some of them over the supervisor's pipes as JSON lines (`encode` /
`decode`); fields marked `wire=False` exist only on the notebook's side.

What each launcher guarantees, in event order, for one job:
`RankStarted` for each rank, `RankOutput` as each rank writes, one
`RankExited` per rank (with its `RankOutcome`: the pickled result or the
exception), then `JobGone` once every process of the job is gone.
`LaunchFailed` and `LauncherDied` say why a job could not run or ended early.

Over 300 lines because every message that crosses a process lives here by design, each a small dataclass.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


# -- the runner's request ----------------------------------------------------------
@dataclass(frozen=True)
class JobRequest:
    """Everything a launcher needs to start the ranks of one call."""

    job_id: str
    name: str
    world_size: int
    #: The pickled call (function or cell, and its arguments), made by payload.serialize.
    payload: bytes
    #: Environment of every rank, before the launcher adds RANK, MASTER_PORT and the rest.
    env: dict[str, str]
    sys_path: list[str]
    cwd: str
    #: Modules each rank imports before the call, calling their `install()`, and whose `flush()` runs
    #: after it: how a listener (MLflow) reaches inside the ranks without the launcher knowing it.
    hooks: tuple[str, ...] = ()
    #: The user's `warm=`: start ranks from a warm helper (fork) rather than as fresh interpreters; None: the
    #: launcher's default. Only a launcher with "warm" in its `supports` reads it.
    warm: bool | None = None
    #: Hot ranks: keep the ranks alive this many seconds after the call, for the next call of the same world.
    keep_alive: float | None = None
    #: What makes two calls the same world (ranks, accelerator type, environment, sys.path): a digest.
    world_key: str = ""
    #: Machines the ranks are spread over, `world_size // num_nodes` on each (more than 1: the Ray launcher).
    num_nodes: int = 1
    #: Each rank gets a GPU of its own (where the launcher places ranks itself).
    use_gpu: bool = False
    #: Which start of the call's world this is (0 the first; TORCHELASTIC_RESTART_COUNT), and how many it may
    #: take beyond the first (TORCHELASTIC_MAX_RESTARTS). Each attempt is a job of its own.
    restart_count: int = 0
    max_restarts: int = 0
    #: A session's name: the ranks keep a namespace between calls (launch/rank/session.py) and outlive a call that
    #: raised; None for a call that is a whole program.
    session: str | None = None
    #: The ranks of a session that run this call (the others run nothing); None: every rank.
    ranks: tuple[int, ...] | None = None


# -- files a rank reads --------------------------------------------------------------
@dataclass(frozen=True)
class JobFile:
    """`job.json` in the run directory: what a rank needs besides the payload to run the call.

    Written by a launcher (`write`), read by the rank (`read`); the one owner of that format.
    """

    name: str
    sys_path: list[str]
    cwd: str
    #: Modules the rank imports before the call (see JobRequest.hooks).
    hooks: list[str] = field(default_factory=list)
    #: See JobRequest.session and JobRequest.ranks.
    session: str | None = None
    ranks: list[int] | None = None

    @classmethod
    def of(cls, request: JobRequest) -> JobFile:
        return cls(
            name=request.name,
            sys_path=list(request.sys_path),
            cwd=request.cwd,
            hooks=list(request.hooks),
            session=request.session,
            ranks=None if request.ranks is None else list(request.ranks),
        )

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> JobFile:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(data).items() if k in known})


# -- supervisor requests (local launcher only) ---------------------------------------
@dataclass(frozen=True)
class Message:
    """Base of everything sent over the supervisor's pipes."""

    registry: ClassVar[dict[str, type[Message]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Message.registry[cls.__name__] = cls


@dataclass(frozen=True)
class LaunchJob(Message):
    """Start the workers of one job (the supervisor's half of a JobRequest)."""

    job: str
    world_size: int
    fork: bool
    executable: str
    sys_path: list[str]
    run_dir: str
    env: dict[str, str]
    package_parent: str
    keep_alive: float | None = None
    world_key: str = ""
    #: The call's hook modules (JobRequest.hooks): the supervisor runs each one's `preload(env)`, if any, in the
    #: background.
    hooks: list[str] = field(default_factory=list)
    restart_count: int = 0
    max_restarts: int = 0
    #: JobRequest.session: the ranks keep a namespace between calls (launch/rank/session.py).
    session: str | None = None
    #: The kept world to run in, an id chosen by the caller's keeper (launch/keeper.py): run in that pool if the
    #: helper has it, else start new ranks and keep them under that id. None: plain ranks that exit with the call.
    pool: str | None = None


@dataclass(frozen=True)
class StopJob(Message):
    """End every process of a job: SIGTERM, then SIGKILL after `grace` seconds.

    With `interrupt_after` (a session's job): first wait that many seconds, then raise KeyboardInterrupt
    in every rank still running (SIGINT); if they all come back within a few seconds the session is kept,
    otherwise their stacks are written and they are stopped as above. A second StopJob without it stops at once.
    """

    job: str
    #: Why the runner stops it (StopReason's words); said when a session ends because of it.
    reason: str
    grace: float
    interrupt_after: float | None = None


@dataclass(frozen=True)
class EndPool(Message):
    """End a kept pool now, saying `why` (idle or not: a call running in it is stopped with it). The caller's keeper
    decided it; the helper carries it out."""

    pool: str
    why: str


@dataclass(frozen=True)
class DumpStacks(Message):
    """Have every process of a job that answers STACKS_SIGNAL write its threads' stacks to its log; nothing stops."""

    job: str


@dataclass(frozen=True)
class Retire(Message):
    """Finish the jobs in hand, take no new ones, then exit."""


@dataclass(frozen=True)
class PrepareHooks(Message):
    """Run the `preload(env)` of these hook modules in the background, as after a call that named them
    (LaunchJob.hooks).

    Sent ahead of the first call, so that the call finds the work done. A preparation holds up only a call
    whose ranks need it (see preload.py).
    """

    hooks: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class HotCall(Message):
    """The supervisor to one hot rank, on its command pipe: run the next call from `run_dir` with `env`."""

    run_dir: str
    env: dict[str, str]


#: A session's hot rank to the supervisor, on its done pipe, as the user's code of the call starts, when a SIGINT
#: raises KeyboardInterrupt in it (between calls the rank ignores SIGINT, so one sent then is lost): the supervisor
#: interrupts no rank before it says so.
TOOK = b"took"


# -- events ------------------------------------------------------------------------
@dataclass(frozen=True)
class Event(Message):
    """Base of what a launcher reports about a job."""


@dataclass(frozen=True)
class RankStarted(Event):
    job: str
    rank: int
    pid: int
    #: The address of the machine the rank runs on, where the launcher knows it (Ray); "": this one.
    host: str = ""


@dataclass(frozen=True)
class RankOutput(Event):
    """Text a rank wrote (stdout and stderr, in order), decoded as UTF-8."""

    job: str
    rank: int
    text: str


@dataclass
class RankOutcome:
    """What a rank left behind: its pickled return value, or the exception it raised."""

    value: bytes | None = None
    error: BaseException | None = None
    #: Wall time the error was recorded (orders the failures of several ranks).
    error_at: float | None = None


@dataclass(frozen=True)
class RankExited(Event):
    job: str
    rank: int
    #: Exit status; negative: killed by that signal.
    returncode: int
    #: Wall time the rank's end was seen (it said it was done just before exiting, or its exit was reaped).
    at: float
    outcome: RankOutcome = field(default_factory=RankOutcome, metadata={"wire": False})
    #: A kept rank's call is over and its process stays usable for the next call (it succeeded, or a session's
    #: rank raised in user code); whether its world stays is the caller's keeper's decision.
    usable: bool = True


@dataclass(frozen=True)
class LaunchFailed(Event):
    """The job could not start, or lost something it needs (its rendezvous store); it is being stopped."""

    job: str
    message: str


@dataclass(frozen=True)
class Stale(Event):
    """A warm supervisor no longer matches the caller (local launcher only; it handles this itself: the same job
    goes to a fresh supervisor, and `reason` goes to the helpers' log)."""

    job: str
    reason: str


@dataclass(frozen=True)
class SessionEnded(Event):
    """A session's ranks ended (`job`: the call during which they did, or "" while idle); said once."""

    job: str
    session: str
    reason: str


@dataclass(frozen=True)
class PoolEnded(Event):
    """A kept pool ended by the helper's own observation (a rank of it died, its rendezvous store died, its call was
    stopped, retirement, the helper's close), or by `EndPool`; `why` is said for a session's."""

    pool: str
    why: str


@dataclass(frozen=True)
class JobGone(Event):
    """Every process of the job is gone; no event follows."""

    job: str


@dataclass(frozen=True)
class LauncherDied(Event):
    """The launcher itself died; the job's processes went with it."""

    job: str
    message: str


# -- the wire ----------------------------------------------------------------------
def encode(message: Message) -> bytes:
    """One JSON line."""
    body = {f.name: getattr(message, f.name) for f in dataclasses.fields(message) if f.metadata.get("wire", True)}
    return (json.dumps({"type": type(message).__name__, **body}) + "\n").encode()


def decode(line: bytes | str) -> Message:
    """The message of one JSON line; ValueError if it is not one."""
    data = json.loads(line)
    cls = Message.registry.get(data.pop("type", ""))
    if cls is None:
        raise ValueError(f"not a message: {line!r}")
    return cls(**data)


# -- the Ray rank actor's calls (Ray launcher only) ------------------------------------
@dataclass(frozen=True)
class ActorPlace:
    """Where a rank's Ray actor runs: its answer to `where`."""

    node_id: str
    ip: str
    pid: int
    #: The GPUs Ray gave the actor.
    gpus: list[str]
    #: A port free on `ip` when it was asked for (rank 0's: MASTER_PORT), else 0.
    free_port: int = 0


@dataclass(frozen=True)
class RankCall:
    """What a rank's actor needs to run one call, besides the payload that travels beside it."""

    rank: int
    job: JobFile
    #: The rank's whole environment for this call (torchrun variables included).
    env: dict[str, str]
    #: Hot: the actor, its imports and its default process group stay for the next call of the same world.
    hot: bool = False


@dataclass(frozen=True)
class RankFiles:
    """What a rank's actor reports once its call is over: the exit code and the files the rank left."""

    code: int | None
    result: bytes | None = None
    error: bytes | None = None
    error_pickle: bytes | None = None
    #: Wall time the error file was written.
    error_at: float | None = None
    #: A session's call that failed in user code: the rank stays usable (worker.session_kept).
    session_kept: bool = False
    #: Other files the rank left in its scratch directory on its node, by name (RunDir.carried_back): its profile's
    #: trace and window, its GPU memory report and out-of-memory snapshot.
    left: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class RankReport:
    """An actor's answer to `poll`: output and relayed metric lines from the offsets asked on, and the
    call's files once it is over and everything it wrote has been read."""

    output: bytes
    metrics: bytes
    done: RankFiles | None = None
    #: Lines for the live charts (the rank's chart file, tracking/tee.py) from the offset asked on.
    charts: bytes = b""
    #: What the rank uses now, sampled on its node: CPU % (100 = one core) and resident bytes, with its children.
    usage: tuple[float, int] | None = None
    #: The rank's step-times file (launch/files/step_times.py) whole, when it changed since the last poll.
    steps: bytes | None = None
    #: What a command run's node wrote in its run directory since the last poll (launch/files/node_mirror.py).
    node_files: tuple[Any, ...] = ()
