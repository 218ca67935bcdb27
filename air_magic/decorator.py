"""The @distributed front door: validate settings, build a JobSpec, hand it to the runner.

`Settings` is shared with the %%distributed magic, so both doors validate
the same way and build the same job description.

Over 300 lines because every option of a call is documented and checked here, once for both doors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from . import accelerators, launch
from .calls import sessions
from .errors import ConfigurationError
from .job import JobResult, JobSpec
from .profiling import check_profile
from .watching import check_watch

if TYPE_CHECKING:
    from .calls.handle import DistributedCall

#: Three hours, in seconds.
DEFAULT_TIMEOUT: float = 3 * 60 * 60

P = ParamSpec("P")
R = TypeVar("R")
_UNSET: Any = object()


def check_timeout(timeout: object) -> float | None:
    """Seconds as a positive number, or None for no limit."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ConfigurationError(
            f"timeout must be a number of seconds or None (no limit), got {timeout!r}; "
            f"for example timeout=3600 for one hour."
        )
    if not math.isfinite(timeout) or timeout <= 0:
        raise ConfigurationError(
            f"timeout must be more than 0 seconds, got {timeout!r}; pass None to run without a time limit."
        )
    return float(timeout)


def check_keep_alive(seconds: object) -> float | None:
    """Hot ranks' idle time in seconds (a positive number), or None for ranks that end with each call."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(
            f"keep_alive must be a number of seconds more than 0, or None (ranks end with each call), got {seconds!r}; "
            "for example keep_alive=600 keeps the ranks ten minutes for the next call."
        )
    return float(seconds)


def check_max_restarts(count: object) -> int:
    """Restarts of the whole world after a rank fails: a whole number, 0 or more."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigurationError(
            f"max_restarts must be a whole number of restarts, 0 or more, got {count!r}; "
            "for example max_restarts=2 starts every rank again up to twice after a rank fails (0: never)."
        )
    return count


@dataclass(frozen=True)
class Settings:
    """How to run: the arguments of `distributed(...)` and the options of `%%distributed`."""

    num_accelerators: int | None = None
    accelerator_type: str | None = None
    timeout: float | None = DEFAULT_TIMEOUT
    mlflow: bool = True
    warm: bool | None = None
    env: dict[str, str] = field(default_factory=dict)
    keep_alive: float | None = None
    #: Machines of a Ray cluster to run on, `num_accelerators` ranks on each; 1 = this node, without Ray.
    num_nodes: int = 1
    #: Times every rank starts again after a rank fails; 0 = the call fails with the first failure.
    max_restarts: int = 0
    #: Run in this session's ranks, which keep what calls build (calls/sessions.py); None = each call is whole.
    session: str | None = None
    #: The ranks of the session that run the call; None = every rank.
    ranks: tuple[int, ...] | None = None
    #: A call whose GPUs (or CPU slots) other calls hold waits for them; False: it fails at once instead.
    wait: bool = True
    #: Watch the call for stragglers and hangs (docs/watching.md); `on_hang`: "report", "stop" or "restart".
    watch: bool = True
    on_hang: str = "report"
    #: The call runs in a process of its own that outlives the kernel (calls/detached.py); `air_magic.attach` finds it.
    detach: bool = False
    #: Profile this many steps of every rank with torch.profiler (docs/profiling.md); None = no profiling.
    profile: int | None = None
    #: GPU ranks keep CUDA's allocation history with Python stacks, for an out-of-memory error's snapshot.
    memory_history: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout", check_timeout(self.timeout))
        check_max_restarts(self.max_restarts)
        check_watch(self.watch, self.on_hang, self.max_restarts)
        check_profile(self.profile, self.watch)
        if not isinstance(self.memory_history, bool):
            raise ConfigurationError(f"memory_history must be True or False, got {self.memory_history!r}.")
        object.__setattr__(self, "keep_alive", check_keep_alive(self.keep_alive))
        if self.num_accelerators is not None:
            accelerators._check_count(self.num_accelerators, "num_accelerators")
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise ConfigurationError(
                f"num_nodes must be a whole number of machines, 1 or more, got {self.num_nodes!r}; "
                "num_nodes=1 (the default) runs on this node."
            )
        if not isinstance(self.mlflow, bool):
            raise ConfigurationError(f"mlflow must be True or False, got {self.mlflow!r}.")
        if not isinstance(self.detach, bool):
            raise ConfigurationError(f"detach must be True or False, got {self.detach!r}.")
        if self.session is not None:
            sessions.check_name(self.session)
        if self.ranks is not None:
            object.__setattr__(self, "ranks", sessions.check_ranks(self.ranks, self.session))

    def resolve(self) -> tuple[int, str]:
        """Ranks per node and accelerator type (raises ConfigurationError if they don't fit).

        One node: checked against this node. Several: only the form is checked here (no Ray is needed
        to decorate); the cluster is asked when the call starts (`spec`).
        """
        return launch.check_shape(self.num_accelerators, self.accelerator_type, self.num_nodes)

    def spec(
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str,
        origin: str = "function",
    ) -> JobSpec:
        per_node, acc_type = launch.resolve_shape(self.num_accelerators, self.accelerator_type, self.num_nodes)
        spec = JobSpec(
            target=target,
            args=args,
            kwargs=kwargs,
            name=name,
            world_size=per_node * self.num_nodes,
            accelerator_type=acc_type,
            timeout=self.timeout,
            mlflow=self.mlflow,
            warm=self.warm,
            extra_env=dict(self.env),
            origin=origin,
            keep_alive=self.keep_alive,
            num_nodes=self.num_nodes,
            max_restarts=self.max_restarts,
            watch=self.watch,
            on_hang=self.on_hang,
            profile=self.profile,
            memory_history=self.memory_history,
        )
        return sessions.with_session(spec, self.session, self.ranks)


def legacy_names(settings: dict[str, Any], gpus: Any, gpu_type: Any) -> dict[str, Any]:
    """Fold the old `gpus` / `gpu_type` arguments into the new ones, with a FutureWarning."""
    for old, new, value in (("gpus", "num_accelerators", gpus), ("gpu_type", "accelerator_type", gpu_type)):
        if value is _UNSET:
            continue
        if settings.get(new) is not None:
            raise ConfigurationError(f"give either {new}= or the old {old}=, not both; use {new}=.")
        warnings.warn(f"distributed({old}=...) is deprecated; use {new}=... instead.", FutureWarning, stacklevel=3)
        if old == "gpu_type" and value is not None:
            if not isinstance(value, str):
                raise ConfigurationError(f"gpu_type must be a string such as 'H100', got {value!r}.")
            value = accelerators.legacy_gpu_type(value, settings.get("num_accelerators"))
        settings[new] = value
    return settings


class DistributedFunction(Generic[P, R]):
    """A function prepared to run on every rank: call `.distributed(...)` to run it."""

    def __init__(self, func: Callable[P, R], settings: Settings) -> None:
        if not callable(func):
            raise ConfigurationError(f"@distributed() must decorate a function, got {func!r}.")
        self._func = func
        self.settings = settings
        functools.update_wrapper(self, func)

    @property
    def func(self) -> Callable[P, R]:
        """The undecorated function, to run it here in the notebook."""
        return self._func

    def distributed(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run on every rank; return the per-rank return values, indexed by global rank."""
        return self.run(*args, **kwargs).values

    def run(self, *args: P.args, **kwargs: P.kwargs) -> JobResult:
        """Like `.distributed`, but return the whole JobResult (run directory, exit codes, timing)."""
        name = str(getattr(self._func, "__qualname__", None) or getattr(self._func, "__name__", "function"))
        if self.settings.detach:
            return self.spawn(*args, **kwargs).job().raise_for_status()
        from .owner import owner

        result: JobResult = owner().submit(self.settings.spec(self._func, args, kwargs, name))
        return result.raise_for_status()

    def spawn(self, *args: P.args, **kwargs: P.kwargs) -> DistributedCall:
        """Start the call in the background and return its handle at once; the kernel is free while it runs.

        `handle.result()` waits for the per-rank values (or raises what `.distributed` would raise); see
        `air_magic.DistributedCall`. A call whose GPUs other calls hold waits for them (`wait=False`: fails).
        """
        from .owner import BACKGROUND, owner

        name = str(getattr(self._func, "__qualname__", None) or getattr(self._func, "__name__", "function"))
        spec = self.settings.spec(self._func, args, kwargs, name)
        if self.settings.detach:
            return owner().detach(spec)
        handle: DistributedCall = owner().submit(spec, BACKGROUND, wait=self.settings.wait)
        return handle

    def with_overrides(self, **changes: Any) -> DistributedFunction[P, R]:
        """A copy with other settings, e.g. `train.with_overrides(num_accelerators=1, timeout=60)`."""
        changes = legacy_names(changes, changes.pop("gpus", _UNSET), changes.pop("gpu_type", _UNSET))
        unknown = set(changes) - {f.name for f in dataclasses.fields(Settings)}
        if unknown:
            raise ConfigurationError(
                f"with_overrides() got unknown setting(s) {sorted(unknown)}; "
                f"known: {sorted(f.name for f in dataclasses.fields(Settings))}."
            )
        settings = dataclasses.replace(self.settings, **changes)
        settings.resolve()  # as at decoration: a setting that cannot fit this node fails here, not at the call
        return DistributedFunction(self._func, settings)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self._func, "__name__", "f")
        raise TypeError(
            f"{name} is decorated with @distributed(); call {name}.distributed(...) to run it on "
            f"every rank, or {name}.func(...) to run it here in this process."
        )

    def __repr__(self) -> str:
        return f"<distributed function {getattr(self._func, '__qualname__', self._func)!r} {self.settings}>"


def distributed(
    num_accelerators: int | None = None,
    accelerator_type: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    *,
    gpus: Any = _UNSET,
    gpu_type: Any = _UNSET,
    mlflow: bool = True,
    warm: bool | None = None,
    env: dict[str, str] | None = None,
    keep_alive: float | None = None,
    num_nodes: int = 1,
    max_restarts: int = 0,
    session: str | None = None,
    wait: bool = True,
    watch: bool = True,
    on_hang: str = "report",
    detach: bool = False,
    profile: int | None = None,
    memory_history: bool = False,
) -> Callable[[Callable[P, R]], DistributedFunction[P, R]]:
    """Prepare a function to run on one worker process per accelerator of this node (or of N nodes).

    num_accelerators: workers to start (per node); None = every GPU (or 2 CPU workers without GPUs).
    accelerator_type: 'GPU_<n>x<MODEL>' such as 'GPU_8xH100', or 'CPU'; None = detected.
    timeout: seconds before every worker is stopped (default 3 h); None = no limit.
    mlflow: record the call as an MLflow run that workers log to.
    warm: start workers from the warm helper (None = the configured default).
    env: extra environment variables for the workers.
    keep_alive: hot ranks: seconds the ranks stay alive after a call for the next call of the same world
        (CUDA context, process group and imports kept); None = they end with each call.
    num_nodes: machines of the Ray cluster joined with `ray_init()`, `num_accelerators` ranks on each;
        1 (the default) runs on this node without Ray.
    max_restarts: when a rank fails (raises, dies, is killed, loses its node), stop every rank and start the
        whole world again, up to this many times; each rank reads TORCHELASTIC_RESTART_COUNT (0 the first
        time) to resume from its own checkpoint. Cancel, Ctrl-C and the timeout (over all attempts) never restart.
    session: run every call in this session's ranks (started by the first call, kept `keep_alive` seconds idle,
        1 h by default), whose namespace keeps what calls build: the function's free globals resolve there
        first, and `Ref("name")` as an argument passes each rank its own object. A call that raises in user code
        keeps the session. See the sessions page of the docs.
    wait: a call whose GPUs (CPU worker slots, on CPU) other calls of this kernel hold waits for them; False: it
        fails at once instead. See the background calls page of the docs.
    watch: each rank's input, compute and collective time per step; a straggler or hung rank named (see the
        watching page of the docs); False: off. on_hang: after a hang, "report" (default: the call goes on),
        "stop" (RankHungError) or "restart" (every rank starts again, within max_restarts).
    detach: `.spawn()` runs the call in a process of its own that outlives this kernel (its SIGKILL, a restart);
        `air_magic.attach(handle.id)` in any kernel finds it again. See the command line and detached runs page.
    profile: profile this many of every rank's steps with torch.profiler (from its third step); the call's
        `JobResult.profile` holds each rank's compute, collective, input and idle time per step, the slowest rank
        and why, and the traces. See the profiling page of the docs.
    memory_history: GPU ranks keep CUDA's allocation history (Python stacks), so that an out-of-memory error names
        the largest live allocations and writes a snapshot; off by default (it costs time on each allocation).
    """
    if callable(num_accelerators) and accelerator_type is None:  # bare @distributed
        return distributed()(num_accelerators)  # type: ignore[return-value]
    given = legacy_names({"num_accelerators": num_accelerators, "accelerator_type": accelerator_type}, gpus, gpu_type)
    settings = Settings(
        timeout=timeout,
        mlflow=mlflow,
        warm=warm,
        env=dict(env or {}),
        keep_alive=keep_alive,
        num_nodes=num_nodes,
        max_restarts=max_restarts,
        session=session,
        wait=wait,
        watch=watch,
        on_hang=on_hang,
        detach=detach,
        profile=profile,
        memory_history=memory_history,
        **given,
    )
    settings.resolve()  # a setting that cannot fit this node fails here, at decoration

    def wrap(func: Callable[P, R]) -> DistributedFunction[P, R]:
        return DistributedFunction(func, settings)

    return wrap
