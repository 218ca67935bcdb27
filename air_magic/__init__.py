"""air_magic: run a notebook's function on every GPU of the node (or of several, through Ray), from one line."""

from __future__ import annotations

from typing import Any

from .accelerators import AcceleratorType, GPUType
from .calls.handle import DistributedCall
from .decorator import distributed
from .errors import (
    AirMagicError,
    ConfigurationError,
    DebuggerQuit,
    DistributedTimeoutError,
    JobCancelledError,
    RankFailedError,
    RankHungError,
    ResultSizeWarning,
    RunDirectoryFullError,
    SerializationError,
    WorkerDiedError,
)
from .job import Alert, JobResult, JobStatus, RankResult, RankState
from .launch import ray_init
from .launch.rank.session import Placeholder, Ref
from .launch.rank.steps import step
from .owner import attach
from .payload import PayloadSizeWarning
from .profiling.profile import Profile
from .stopping import should_stop
from .sweep import sweep

__version__ = "0.1.0"
#: Everything users import; the rest of the package is internal (tests/test_public.py keeps this honest).
__all__ = [
    "AcceleratorType",
    "AirMagicError",
    "Alert",
    "ConfigurationError",
    "DebuggerQuit",
    "DistributedCall",
    "DistributedTimeoutError",
    "GPUType",
    "JobCancelledError",
    "JobResult",
    "JobStatus",
    "PayloadSizeWarning",
    "Placeholder",
    "Profile",
    "RankFailedError",
    "RankHungError",
    "RankResult",
    "RankState",
    "Ref",
    "ResultSizeWarning",
    "RunDirectoryFullError",
    "SerializationError",
    "WorkerDiedError",
    "__version__",
    "attach",
    "distributed",
    "load_ipython_extension",
    "ray_init",
    "should_stop",
    "step",
    "sweep",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext air_magic`: register the %%distributed magic."""
    from .magics import load_ipython_extension as load

    load(ipython)
    _prepare_first_call(ipython)


def _prepare_first_call(ipython: Any) -> None:
    """Start, in the background, what a first call would wait for: the supervisor (it imports torch, not CUDA)
    and, unless %%distributed cells are configured without MLflow, MLflow's import and store set-up in this
    process. Returns at once; a call made earlier waits for it."""
    from .owner import owner
    from .tracking.prepare import start

    launchers = owner().launchers
    launchers.start_local_helper()
    if ipython.config.get("DistributedMagics", {}).get("mlflow", True) is not False:
        start(launchers.prepare_hooks)


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext air_magic`: remove the magic and stop the supervisor."""
    from .magics import unload_ipython_extension as unload

    unload(ipython)


def _arm() -> None:
    from . import notebook_code

    notebook_code.arm()  # in a kernel: the notebook's own modules travel even without %load_ext air_magic


_arm()
