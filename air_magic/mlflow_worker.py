"""Inside a worker: make `mlflow.set_experiment` explain itself instead of failing later.

The call's run already exists, in the experiment chosen in the notebook; the
worker logs to it through `MLFLOW_RUN_ID`. Without this hook a worker that
calls `mlflow.set_experiment("other")` gets MLflow's "active experiment ID does
not match environment run ID" at its first `log_metric`. With it, the call is
kept on the run's experiment and a warning (in the rank's log) says where the
metrics go and how to choose another experiment.

With AIR_MAGIC_MLFLOW_RELAY set (a rank on another machine than a local
store), it also registers the relay store (mlflow_relay.py) that the rank's
tracking URI names.

This module never imports mlflow: `install()` adds an import hook that patches
mlflow only if the user's code imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any


def _patch(mlflow: ModuleType) -> None:
    if os.environ.get("AIR_MAGIC_MLFLOW_RELAY"):
        from .mlflow_relay import register

        register()  # this rank cannot reach the store: what it logs goes back through the launcher
    original = mlflow.set_experiment
    run_id = os.environ.get("AIR_MAGIC_MLFLOW_RUN_ID", "")
    exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID", "")
    exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "")

    def set_experiment(experiment_name: str | None = None, experiment_id: str | None = None, **kwargs: Any) -> Any:
        if experiment_id is not None and str(experiment_id) == exp_id or experiment_name == exp_name:
            return original(experiment_id=exp_id)
        asked = f"experiment_id={experiment_id!r}" if experiment_id is not None else repr(experiment_name)
        warnings.warn(
            f"air_magic: mlflow.set_experiment({asked}) ignored on rank {os.environ.get('RANK', '?')}: "
            f"this call logs to its MLflow run {run_id} in experiment {exp_name!r}, made in the notebook. "
            f"To use another experiment, call mlflow.set_experiment({asked}) in the notebook before the call.",
            UserWarning,
            stacklevel=2,
        )
        return original(experiment_id=exp_id)

    set_experiment.__doc__ = original.__doc__
    mlflow.set_experiment = set_experiment  # type: ignore[attr-defined]
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is not None:
        fluent.set_experiment = set_experiment  # type: ignore[attr-defined]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of `mlflow` so the patch runs right after it loads."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != "mlflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module  # type: ignore[attr-defined]

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch mlflow when (and only if) it is imported in this process."""
    if "mlflow" in sys.modules:
        _patch(sys.modules["mlflow"])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def flush(timeout: float = 120.0) -> None:
    """Send what MLflow's asynchronous logging still holds and stop its threads, before interpreter shutdown.

    Bounded by `timeout` seconds, so an unreachable tracking server cannot keep a finished rank alive.
    """
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return
    fluent = sys.modules.get("mlflow.tracking.fluent")
    # Shutting the queue down (not just flushing it) also ends its threads, so the rank can exit.
    shut_down = getattr(fluent, "_shut_down_async_logging", None) or mlflow.flush_async_logging

    def run() -> None:
        try:
            shut_down()
        except Exception as exc:  # noqa: BLE001 - reported in the rank's log; the result stands
            print(f"air_magic: MLflow could not send the last metrics of this rank: {exc!r}", file=sys.stderr)

    import threading

    sender = threading.Thread(target=run, name="air_magic-mlflow-flush", daemon=True)
    sender.start()
    sender.join(timeout)
    if sender.is_alive():
        print(f"air_magic: MLflow was still sending this rank's last metrics after {timeout:g} s; "
              "the rank exits without waiting longer.", file=sys.stderr)
