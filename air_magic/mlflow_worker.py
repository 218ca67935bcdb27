"""Inside a worker: make `mlflow.set_experiment` explain itself, and copy logged metrics for the live charts.

The call's run already exists, in the experiment chosen in the notebook; the
worker logs to it through `MLFLOW_RUN_ID`. Without this hook a worker that
calls `mlflow.set_experiment("other")` gets MLflow's "active experiment ID does
not match environment run ID" at its first `log_metric`. With it, the call is
kept on the run's experiment and a warning (in the rank's log) says where the
metrics go and how to choose another experiment.

`mlflow.log_metric` / `log_metrics` also append each value as a JSON line
(`{"key", "value", "step", "ts"}`) to `rank-N.metrics.jsonl` in the run
directory (mode 0600), which the notebook's display reads for its charts
without asking the tracking server (`_tee_metrics`).

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
    _tee_metrics(mlflow, run_id)


def _tee_metrics(mlflow: ModuleType, run_id: str) -> None:
    """Make log_metric/log_metrics also append their values to this rank's metrics file in the run directory."""
    run_dir, rank = os.environ.get("AIR_MAGIC_RUN_DIR"), os.environ.get("RANK")
    if not run_dir or rank is None or getattr(mlflow.log_metric, "_air_magic_tee", False):
        return
    path = os.path.join(run_dir, f"rank-{rank}.metrics.jsonl")
    import json
    import threading
    import time

    lock = threading.Lock()
    state: dict[str, Any] = {"fd": None}

    prefixes: dict[Any, str] = {}  # the JSON text before each key's value, made once per key

    def line(key: Any, value: Any, step: Any, now: float) -> str:
        prefix = prefixes.get(key)
        if prefix is None:
            prefix = prefixes[key] = '{"key":' + json.dumps(str(key)) + ',"value":'
        return f'{prefix}{float(value)!r},"step":{"null" if step is None else int(step)},"ts":{now!r}}}\n'

    def write(items: list[tuple[Any, Any, Any]]) -> None:
        try:
            now = time.time()
            data = "".join(line(k, v, s, now) for k, v, s in items).encode()
            with lock:  # one os.write per call: lines of two threads never mix
                if state["fd"] is None:
                    state["fd"] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                os.write(state["fd"], data)
        except (OSError, TypeError, ValueError, OverflowError):
            pass  # the charts are a convenience; the metric itself was logged

    def ours(target: Any) -> bool:
        return target is None or str(target) == run_id

    original_metric, original_metrics = mlflow.log_metric, mlflow.log_metrics

    def log_metric(key: str, value: float, step: int | None = None, *args: Any, **kwargs: Any) -> Any:
        out = original_metric(key, value, step, *args, **kwargs)
        if ours(kwargs.get("run_id", args[2] if len(args) > 2 else None)):  # (synchronous, timestamp, run_id)
            write([(key, value, step)])
        return out

    def log_metrics(metrics: dict[str, float], step: int | None = None, *args: Any, **kwargs: Any) -> Any:
        out = original_metrics(metrics, step, *args, **kwargs)
        if ours(kwargs.get("run_id", args[1] if len(args) > 1 else None)):  # (synchronous, run_id)
            write([(k, v, step) for k, v in metrics.items()])
        return out

    for new, old in ((log_metric, original_metric), (log_metrics, original_metrics)):
        wrapper: Any = new
        wrapper.__doc__, wrapper.__wrapped__, wrapper._air_magic_tee = old.__doc__, old, True
    mlflow.log_metric = log_metric  # type: ignore[attr-defined]
    mlflow.log_metrics = log_metrics  # type: ignore[attr-defined]


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


def reset() -> None:
    """Between two calls in a hot rank: send what is queued, and forget this call's run (the next call attaches its own)."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return
    try:
        mlflow.flush_async_logging()
    except Exception as exc:  # noqa: BLE001 - reported in the rank's log; the result stands
        print(f"air_magic: MLflow could not send this call's last metrics: {exc!r}", file=sys.stderr)
    fluent = sys.modules.get("mlflow.tracking.fluent")
    stack = getattr(fluent, "_active_run_stack", None)
    if stack is not None:
        stack.get().clear()  # the run stays as the notebook ends it; this process just lets go of it


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
