"""The only module that touches MLflow's private names: each one behind a function named for what it gives.

MLflow keeps no promise about these; `pyproject.toml` bounds the MLflow major
version this package was checked against, and tests/unit/test_tracking_formats.py
checks every function here against the installed MLflow. Functions that only
read state (`active_run_stack`, ...) return None when MLflow, or the name, is not
there, and never import MLflow themselves; the others import what they need.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

#: Name of the thread MLflow's asynchronous logging runs while its queue is active (mlflow 2.x-3.x).
ASYNC_LOOP_THREAD = "MLflowAsyncLoggingLoop"


def _fluent() -> Any:
    """`mlflow.tracking.fluent` if this process has imported it, else None."""
    return sys.modules.get("mlflow.tracking.fluent")


def experiment_id_from_env() -> str:
    """The experiment MLFLOW_EXPERIMENT_NAME / MLFLOW_EXPERIMENT_ID select, as MLflow's fluent API resolves them."""
    from mlflow.tracking import fluent

    return str(fluent._get_experiment_id())


def active_experiment_id() -> str | None:
    """The experiment this process chose with `mlflow.set_experiment`, if any (None before mlflow is imported)."""
    fluent = _fluent()
    value = getattr(fluent, "_active_experiment_id", None)
    return None if value is None else str(value)


def active_run_stack() -> list[Any] | None:
    """This thread's stack of active runs (the list itself, so it can be cleared), or None."""
    holder = getattr(_fluent(), "_active_run_stack", None)
    return None if holder is None else holder.get()  # type: ignore[no-any-return]


def has_system_metrics_monitor() -> bool:
    """Whether a run of this process has MLflow's system-metrics monitor, which must end with the run."""
    return bool(getattr(_fluent(), "run_id_to_system_metrics_monitor", None))


def shut_down_async_logging_function(mlflow: Any) -> Callable[[], None]:
    """What sends everything MLflow's asynchronous logging holds and stops its threads (else a plain flush)."""
    shut_down = getattr(_fluent(), "_shut_down_async_logging", None)
    return shut_down or mlflow.flush_async_logging  # type: ignore[no-any-return]


def tracking_store(uri: str) -> Any:
    """MLflow's tracking store for `uri`, as MLflow caches it per URI in this process (built on first use)."""
    from mlflow.tracking._tracking_service import utils

    return utils._get_store(uri)


def register_tracking_store(scheme: str, factory: Callable[..., Any]) -> None:
    """Make `<scheme>:` a tracking URI of this process whose store `factory(store_uri, artifact_uri)` returns."""
    from mlflow.tracking._tracking_service import utils

    utils._tracking_store_registry.register(scheme, factory)
