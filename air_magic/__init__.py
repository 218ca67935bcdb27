"""air_magic: run a notebook's training function on every GPU of the node (or of several, through Ray), from one line."""

from __future__ import annotations

from typing import Any

from .accelerators import AcceleratorType, GPUType
from .decorator import distributed
from .errors import (
    AirMagicError,
    ConfigurationError,
    DistributedTimeoutError,
    JobCancelledError,
    RankFailedError,
    ResultSizeWarning,
    RunDirectoryFullError,
    SerializationError,
    WorkerDiedError,
)
from .job import JobResult, JobStatus, RankResult, RankState
from .launch.ray.cluster import ray_init
from .payload import PayloadSizeWarning

__version__ = "0.1.0"
#: Everything users import; the rest of the package is internal (tests/test_public.py keeps this honest).
__all__ = [
    "AcceleratorType",
    "AirMagicError",
    "ConfigurationError",
    "DistributedTimeoutError",
    "GPUType",
    "JobCancelledError",
    "JobResult",
    "JobStatus",
    "PayloadSizeWarning",
    "RankFailedError",
    "RankResult",
    "RankState",
    "ResultSizeWarning",
    "RunDirectoryFullError",
    "SerializationError",
    "WorkerDiedError",
    "__version__",
    "distributed",
    "load_ipython_extension",
    "ray_init",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext air_magic`: register the %%distributed magic."""
    from .launch.local import warm_up
    from .magics import load_ipython_extension as load

    load(ipython)
    warm_up()  # start the supervisor in the background: it imports torch, not CUDA


def unload_ipython_extension(ipython: Any) -> None:
    """`%unload_ext air_magic`: remove the magic and stop the supervisor."""
    from .magics import unload_ipython_extension as unload

    unload(ipython)
