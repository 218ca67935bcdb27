"""MLflow tracking of a call: one run per call that every rank logs to (the only module that imports mlflow).

`MlflowTracker` is a runner listener. On start it creates the call's run (a
child of the notebook's active run when there is one), records the settings
and puts the run's link in `ctx.links["mlflow"]`; it hands the workers the
run id and tracking URI through the environment, so a plain
`mlflow.log_metric(...)` in the function lands on that run; on end it stores
each rank's log as an artifact and ends the run FINISHED, FAILED or KILLED.

When the ranks run on other machines (`num_nodes > 1`) and the store is a
local file here, they cannot open it: their tracking URI becomes the relay
(mlflow_relay.py), and this listener logs what they relayed to the run,
about once a second while they run and once more at the end.

This module is imported in the notebook process only. Workers never import
mlflow on our account: the environment variables are all they get (and, when
relayed, the relay store once their own code imports mlflow).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .events import Listener, RunContext
from .job import JobResult, JobSpec

#: Experiment used when neither mlflow.set_experiment nor MLFLOW_EXPERIMENT_NAME/ID chose one
#: and the notebook or script name is unknown.
FALLBACK_EXPERIMENT = "air_magic"

#: Environment variables that make `mlflow.log_metric` in a worker cheap and safe for
#: concurrent writers: MLflow's own asynchronous logging, buffered into batches of up to
#: 1,000 items once a second, one writer thread per rank. The user's own values win.
ASYNC_LOGGING_ENV = {
    "MLFLOW_ENABLE_ASYNC_LOGGING": "true",
    "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS": "1",
    "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE": "1",
}


def absolute_uri(uri: str) -> str:
    """`uri` with a relative sqlite or file path made absolute, so workers and the UI open the same store."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if path and not path.startswith("/") and path != ":memory:":
            return "sqlite:///" + os.path.abspath(path)
        return uri
    if parsed.scheme in ("", "file") and not parsed.netloc:
        path = parsed.path if parsed.scheme == "file" else uri
        return Path(os.path.abspath(path)).as_uri()
    return uri


def default_experiment_name() -> str:
    """The notebook's file name under Jupyter, else the script's, else 'air_magic'."""
    session = os.environ.get("JPY_SESSION_NAME")
    if session:
        return os.path.basename(session.rstrip("/")) or FALLBACK_EXPERIMENT
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script and "ipykernel" not in script and not script.endswith("ipython"):
        return os.path.basename(script)
    return FALLBACK_EXPERIMENT


class MlflowTracker(Listener):
    """Makes and ends the MLflow run of one call; see the module docstring."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.experiment_name: str | None = None
        self.tracking_uri: str | None = None
        self.registry_uri: str | None = None
        self.url: str | None = None
        self._ctx: RunContext | None = None
        self._relayed: dict[int, int] = {}  # rank -> bytes of its metrics file already logged
        self._next_relay = 0.0
        self.relay_errors: list[str] = []

    # -- on start ----------------------------------------------------------
    def _experiment(self, mlflow: Any, client: Any) -> tuple[str, str]:
        """(id, name) of the experiment chosen by the user, else of the default one (created if needed)."""
        from mlflow.tracking import fluent

        if fluent._active_experiment_id is not None or os.environ.get("MLFLOW_EXPERIMENT_NAME") or \
                os.environ.get("MLFLOW_EXPERIMENT_ID"):
            experiment_id = fluent._get_experiment_id()
            return str(experiment_id), str(client.get_experiment(experiment_id).name)
        name = default_experiment_name()
        found = client.get_experiment_by_name(name)
        if found is None:
            try:
                return client.create_experiment(name), name
            except mlflow.exceptions.MlflowException:  # another kernel made it first
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise
        return found.experiment_id, name

    def on_start(self, ctx: RunContext) -> None:
        try:
            self._start(ctx)
        except Exception as exc:  # noqa: BLE001 - an unreachable tracking server must not stop training
            self.run_id = None
            warnings.warn(
                f"air_magic: MLflow tracking is off for this call because the run could not be created "
                f"({type(exc).__name__}: {exc}). Check MLFLOW_TRACKING_URI, or pass mlflow=False "
                f"(--no-mlflow for %%distributed) to run without MLflow.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _start(self, ctx: RunContext) -> None:
        self._ctx = ctx
        import mlflow
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_SOURCE_NAME, MLFLOW_USER

        from . import mlflow_ui

        self.tracking_uri = absolute_uri(mlflow.get_tracking_uri())
        self.registry_uri = absolute_uri(mlflow.get_registry_uri() or self.tracking_uri)
        client = MlflowClient(self.tracking_uri, self.registry_uri)
        self.client = client
        spec = self.spec
        tags = {
            MLFLOW_SOURCE_NAME: os.environ.get("JPY_SESSION_NAME") or default_experiment_name(),
            "air_magic.run_dir": str(ctx.run_dir),
        }
        user = os.environ.get("USER") or os.environ.get("LOGNAME")
        if user:
            tags[MLFLOW_USER] = user
        parent = mlflow.active_run()
        if parent is not None:
            self.experiment_id = parent.info.experiment_id
            self.experiment_name = client.get_experiment(self.experiment_id).name
            tags[MLFLOW_PARENT_RUN_ID] = parent.info.run_id
        else:
            self.experiment_id, self.experiment_name = self._experiment(mlflow, client)
        run = client.create_run(self.experiment_id, run_name=spec.name, tags=tags)
        self.run_id = run.info.run_id
        kind = spec.origin
        params = {
            kind: spec.name,
            "world_size": spec.world_size,
            "accelerator_type": spec.accelerator_type,
            "timeout": "none" if spec.timeout is None else f"{spec.timeout:g}",
        }
        if spec.num_nodes > 1:
            params["num_nodes"] = spec.num_nodes
        client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()], synchronous=True)
        self.url = mlflow_ui.run_url(self.tracking_uri, self.experiment_id, self.run_id)
        if self.url:
            ctx.links["mlflow"] = self.url

    def worker_hooks(self) -> list[str]:
        """The MLflow hook (mlflow_worker.py) in every rank of a call that has a run."""
        return ["air_magic.mlflow_worker"] if self.run_id is not None else []

    @property
    def relayed(self) -> bool:
        """The ranks run on other machines and the store is a local file here: they relay through the launcher."""
        scheme = urlparse(self.tracking_uri or "").scheme
        return self.spec.num_nodes > 1 and scheme in ("sqlite", "file", "")

    def worker_env(self) -> dict[str, str]:
        if self.run_id is None or self.tracking_uri is None:
            return {}
        env = {
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MLFLOW_REGISTRY_URI": self.registry_uri or self.tracking_uri,  # spares a pyspark probe per call
            "MLFLOW_RUN_ID": self.run_id,
            "MLFLOW_EXPERIMENT_ID": str(self.experiment_id),
            "MLFLOW_EXPERIMENT_NAME": str(self.experiment_name),
            "AIR_MAGIC_MLFLOW_RUN_ID": self.run_id,
        }
        for key, value in ASYNC_LOGGING_ENV.items():
            env[key] = os.environ.get(key, value)
        if self.relayed:
            from .mlflow_relay import URI

            env.update(MLFLOW_TRACKING_URI=URI, AIR_MAGIC_MLFLOW_RELAY="1")
            env.pop("MLFLOW_REGISTRY_URI")
        return env

    # -- while it runs (relayed ranks) ----------------------------------------
    def poll(self) -> None:
        if self.run_id is not None and self.relayed and time.monotonic() >= self._next_relay:
            self._next_relay = time.monotonic() + 1.0
            self.relay()

    def relay(self) -> None:
        """Log to the run what relayed ranks wrote to their metrics files since the last time."""
        from mlflow.entities import Metric, Param, RunTag

        from .launch.rundir import RunDir

        assert self.run_id is not None and self._ctx is not None
        run_dir = RunDir(self._ctx.run_dir)
        for rank in range(self.spec.world_size):
            path = run_dir.metrics(rank)
            try:
                with open(path, "rb") as f:
                    f.seek(self._relayed.get(rank, 0))
                    data = f.read()
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]
            self._relayed[rank] = self._relayed.get(rank, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    record = json.loads(line)
                    self.client.log_batch(
                        self.run_id,
                        metrics=[Metric(k, float(v), int(t), int(s)) for k, v, t, s in record.get("metrics", ())],
                        params=[Param(k, str(v)) for k, v in record.get("params", ())],
                        tags=[RunTag(k, str(v)) for k, v in record.get("tags", ())],
                        synchronous=True,
                    )
                except Exception as exc:  # noqa: BLE001 - one bad line (a param logged twice) must not stop the rest
                    self.relay_errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    # -- on end ------------------------------------------------------------
    def on_end(self, result: JobResult) -> None:
        if self.run_id is None:
            return
        try:
            if self.relayed:
                self.relay()
                if self.relay_errors:
                    warnings.warn(
                        f"air_magic: {len(self.relay_errors)} record(s) the ranks logged could not be stored in MLflow "
                        f"run {self.run_id}; the first: {self.relay_errors[0]}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            for rank in result.ranks:
                if rank.log_path is not None and rank.log_path.exists():
                    self.client.log_artifact(self.run_id, str(rank.log_path), artifact_path="logs")
        except Exception as exc:  # noqa: BLE001 - the call's own outcome matters more than its logs
            warnings.warn(
                f"air_magic could not store the rank logs in MLflow run {self.run_id}: {exc!r}. "
                f"They are still in {result.run_dir}.",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            self.client.set_terminated(self.run_id, result.status.value)


def make_tracker(spec: JobSpec) -> Listener | None:
    """The MLflow listener for `spec`, or None when MLflow is off."""
    if not spec.mlflow:
        return None
    return MlflowTracker(spec)
