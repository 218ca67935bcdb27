"""Inside a rank: the MLflow hook. Makes `mlflow.set_experiment` explain itself, and copies logged metrics
for the live charts.

The call's run already exists, in the experiment chosen in the notebook; the
rank logs to it through `MLFLOW_RUN_ID`. Without this hook a rank that
calls `mlflow.set_experiment("other")` gets MLflow's "active experiment ID does
not match environment run ID" at its first `log_metric`. With it, the call is
kept on the run's experiment and a warning (in the rank's log) says where the
metrics go and how to choose another experiment.

`mlflow.log_metric` / `log_metrics` also hand each value to the chart file's
writer (tee.py), which the notebook's display reads for its charts without
asking the tracking server (`_tee_metrics`).

Importing this module does not import mlflow: `install()` adds an import hook
that patches mlflow only if the user's code imports it. Also here: `flush()`
(at a rank's exit, only when MLflow has metrics in flight), `reset()` (between
two calls of a hot rank) and `preload()` (run by a warm helper in the background,
so a rank's `import mlflow` and first `log_metric` cost milliseconds).

With AIR_MAGIC_MLFLOW_RELAY set (a rank on another machine than a local
store), it also registers the relay store (relay.py) that the rank's
tracking URI names.

Over 300 lines because it is the only MLflow code that runs in a rank, and each logging entry point it wraps
needs its own few lines.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ..envvars import INTERNAL_RUN_DIR, MLFLOW_RELAY, MLFLOW_RUN_ID
from ..launch.files.rundir import RunDir
from . import _compat
from .tee import TeeWriter

#: The chart file's writer of the call running now, and its run id (a hot rank's next call has its own).
_tee: dict[str, Any] = {}


def _patch(mlflow: ModuleType) -> None:
    """Patch mlflow for the call about to run (a hot rank runs this at each call: what it sets is per call)."""
    if os.environ.get(MLFLOW_RELAY):
        from .relay import register

        register()  # this rank cannot reach the store: what it logs goes back through the launcher
    original = getattr(mlflow.set_experiment, "_air_magic_original", mlflow.set_experiment)
    run_id = os.environ.get(MLFLOW_RUN_ID, "")
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
    set_experiment._air_magic_original = original  # type: ignore[attr-defined]  # the next call wraps it anew
    mlflow.set_experiment = set_experiment  # type: ignore[attr-defined]
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is not None:
        fluent.set_experiment = set_experiment  # type: ignore[attr-defined]
    _tee_metrics(mlflow, run_id)


def _tee_metrics(mlflow: ModuleType, run_id: str) -> None:
    """Make log_metric/log_metrics also append their values to this call's chart file in its run directory."""
    run_dir, rank = os.environ.get(INTERNAL_RUN_DIR), os.environ.get("RANK")
    if not run_dir or rank is None:
        return
    path = str(RunDir(Path(run_dir)).chart_metrics(int(rank)))
    if _tee.get("path") != path:
        if "writer" in _tee:
            _tee["writer"].close()
        _tee.update(path=path, writer=TeeWriter(path))
    _tee["run_id"] = run_id
    if getattr(mlflow.log_metric, "_air_magic_tee", False):
        return  # patched by an earlier call of this hot rank: it writes where _tee says now

    def write(items: list[tuple[Any, Any, Any]]) -> None:
        _tee["writer"].write(items)

    def ours(target: Any) -> bool:
        return target is None or str(target) == _tee["run_id"]

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


def _find_spec(name: str, path: Sequence[str] | None) -> Any:
    """The spec the rest of sys.meta_path gives `name` (a warm worker's preloaded copy comes first)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = None if find is None else find(name, path)
        if spec is not None:
            return spec
    return None


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of `mlflow` so the patch runs right after it loads."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != "mlflow":
            return None
        sys.meta_path.remove(self)
        spec = _find_spec(name, path)
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
    """Between two calls in a hot rank: send what is queued, and forget this call's run (the next attaches its own)."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return
    if _async_logging_running():
        # Shut down, not flush: a flush restarts MLflow's logging thread, which then outlives the call and,
        # once the next call's environment lacks the buffering setting, holds that call's end for 1 s.
        _send_queued(mlflow, 120.0)
    stack = _compat.active_run_stack()
    if stack is not None:
        stack.clear()  # the run stays as the notebook ends it; this process just lets go of it


def leave_run_to_notebook() -> None:
    """At a rank's exit: leave ending the call's run to the notebook, which sets its final status anyway.

    Otherwise MLflow's own exit hook ends it from every rank: one more write to the store per rank
    (ranks contend for it on sqlite), and MLflow's "View run" lines in each rank's log. Only when the
    call's run is the only active run and no system-metrics monitor needs ending with it.
    """
    try:
        stack = _compat.active_run_stack()
        if (
            stack is not None
            and [run.info.run_id for run in stack] == [os.environ.get(MLFLOW_RUN_ID)]
            and not _compat.has_system_metrics_monitor()
        ):
            stack.clear()
    except Exception:  # noqa: BLE001 - MLflow internals moved: keep MLflow's own behaviour
        return


def _async_logging_running() -> bool:
    """Whether this process has MLflow metrics queued or in flight: its asynchronous logging thread is alive.

    Threads do not survive fork, so a rank forked from a helper that imported mlflow starts with none.
    Asking MLflow itself (its store's queue) would build the tracking store first, which costs a database
    connection and schema check (1-3 s) in a rank that never logged anything.
    """
    import threading

    return any(t.name == _compat.ASYNC_LOOP_THREAD and t.is_alive() for t in threading.enumerate())


def flush(timeout: float = 120.0) -> None:
    """At a rank's exit: send what MLflow's asynchronous logging still holds and stop its threads, then
    leave ending the run to the notebook (`leave_run_to_notebook`).

    Bounded by `timeout` seconds, so an unreachable tracking server cannot keep a finished rank alive.
    """
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and _async_logging_running():
        _send_queued(mlflow, timeout)
    leave_run_to_notebook()


def _send_queued(mlflow: ModuleType, timeout: float) -> None:
    # Shutting the queue down (not just flushing it) also ends its threads, so the rank can exit.
    shut_down = _compat.shut_down_async_logging_function(mlflow)

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
        print(
            f"air_magic: MLflow was still sending this rank's last metrics after {timeout:g} s; "
            "the rank exits without waiting longer.",
            file=sys.stderr,
        )


#: What `preload` brings into the helper: a call whose code names it has the preparation finished before its
#: ranks are forked (launch/local/preload.py).
PRELOADS = ("mlflow",)


def preload(env: dict[str, str]) -> list[str]:
    """In the warm helper, in the background: make a forked rank's `import mlflow` and first `log_metric` cheap.

    Imports mlflow and the tracking store of `env`'s MLFLOW_TRACKING_URI (for sqlite, SQLAlchemy,
    alembic and MLflow's table models: most of a rank's first log call), and for a sqlite store
    builds the store object itself, whose construction reads every schema migration to check the
    database (about 0.2 s a process). MLflow caches stores per URI, so ranks forked afterwards find
    it built. Without a URI in `env` (asked at load, before the notebook has made its store's tables), the
    code of MLflow's default (sqlite) store is imported but no store is built. Called between calls in a
    process that forks: it starts no thread, and the store's connections are closed again (each rank opens
    its own). Returns the packages it preloaded.

    The packages with extension modules that `import mlflow` loads come first, each on its own: the helper
    interrupts a preparation for a call only where that drops no extension module, so this keeps mlflow's own
    (pure Python) import interruptible.
    """
    for dependency in MLFLOW_EXTENSIONS:
        try:
            if importlib.util.find_spec(dependency.partition(".")[0]) is not None:
                importlib.import_module(dependency)
        except ImportError:
            continue  # not what this mlflow uses
    import mlflow

    uri = env.get("MLFLOW_TRACKING_URI") or ""
    scheme = uri.partition(":")[0]
    if not uri and mlflow.get_tracking_uri().startswith("sqlite:"):
        # Asked before the notebook has set up its store (whose tables a store built here would race): the code of
        # MLflow's default store only, most of the store's cost; the store itself is built when it is asked again.
        import mlflow.store.tracking.sqlalchemy_store
        import sqlalchemy.orm

        sqlalchemy.orm.configure_mappers()
    elif scheme in ("http", "https"):
        # What a rank's first request imports; no HTTP session is made here (it would be shared by every fork).
        import netrc  # noqa: F401 - requests reads ~/.netrc on each request

        import mlflow.store.tracking.rest_store
        import mlflow.tracking.request_header.registry

        if importlib.util.find_spec("IPython") is not None:
            import IPython  # noqa: F401 - MLflow's Databricks check imports it on a rank's first request (~1 s)
    elif scheme == "sqlite" and uri not in _warmed:
        import sqlalchemy.orm

        store = _compat.tracking_store(uri)
        sqlalchemy.orm.configure_mappers()
        if env.get("MLFLOW_RUN_ID"):
            # A read of the call's (ended) run compiles the queries of a rank's attachment to its run into
            # SQLAlchemy's statement cache, which lives on the engine and is inherited by every fork.
            store.get_run(env["MLFLOW_RUN_ID"])
        engine = getattr(store, "engine", None)
        if engine is not None:
            engine.dispose()  # no connection may cross the fork
        _warmed.add(uri)
    del mlflow
    return ["mlflow"]


#: Modules with (or behind) extension modules that `import mlflow` loads, in the order it loads them (preload).
MLFLOW_EXTENSIONS = (
    "google.protobuf.descriptor",
    "pydantic_core",
    "psutil",
    "charset_normalizer",
    "requests",
    "yaml",
    "pyarrow.fs",
    "pandas",
    "numpy.random",
    "scipy.sparse",
)

#: Tracking URIs whose store preload built in this process.
_warmed: set[str] = set()
