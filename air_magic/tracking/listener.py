"""The notebook's MLflow listener: one run per call that every rank logs to.

`MlflowTracker` is a runner listener. On start it creates the call's run (a
child of the notebook's active run when there is one), records the settings
and puts the run's link in `ctx.links["mlflow"]`; it hands the ranks the
run id and tracking URI through the environment, so a plain
`mlflow.log_metric(...)` in the function lands on that run; on end it stores
each rank's log as an artifact and ends the run FINISHED, FAILED or KILLED.

The run is made on a background thread that `on_start` starts and
`worker_env` waits for; that thread first waits for the notebook's MLflow
preparation (prepare.py: importing mlflow and setting up the store, started
when the extension loads), so a call made while it is still going waits for
it instead of doing it twice. MLflow's own INFO lines (such as "Creating
initial MLflow database tables") are kept out of the cell's output.

With MLflow's local default store (`sqlite:///mlflow.db`) and an experiment
that air_magic creates, artifacts (each rank's log) go to `mlartifacts/`
next to the database, not to MLflow's `./mlruns` default.

When the ranks run on other machines (`num_nodes > 1`) and the store is a
local file here, they cannot open it: their tracking URI becomes the relay
(relay.py), and this listener logs what they relayed to the run, about once
a second while they run and once more at the end.

Runs in the notebook process only. The ranks get environment variables and
the hook module (hook.py), which imports mlflow only if their code does.

Over 300 lines because one run's life (create, nest, log settings and artifacts, end with the call's status) is
one listener's job.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..envvars import MLFLOW_RELAY, MLFLOW_RUN_ID
from ..job import JobResult, JobSpec
from ..launch.files.rundir import RunDir
from ..listeners import Listener, RunContext
from ..phase import Phase
from . import _compat, prepare
from .store import (
    FALLBACK_EXPERIMENT,
    HOOK,
    absolute_uri,
    default_experiment_name,
    quiet_mlflow_logs,
    sqlite_artifact_root,
)

#: Environment variables that make `mlflow.log_metric` in a worker cheap and safe for
#: concurrent writers: MLflow's own asynchronous logging, buffered into batches of up to
#: 1,000 items once a second, one writer thread per rank. The user's own values win.
ASYNC_LOGGING_ENV = {
    "MLFLOW_ENABLE_ASYNC_LOGGING": "true",
    "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS": "1",
    "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE": "1",
}


class MlflowTracker(Listener):
    """Makes and ends the MLflow run of one call; see the module docstring."""

    start_phase = Phase.CREATING_RUN

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
        self.captured = False  # capture() read the spawning thread's active run (a background call)
        self.parent_run_id: str | None = None
        self.chosen_experiment: str | None = None

    # -- on start ----------------------------------------------------------
    def _experiment(self, mlflow: Any, client: Any) -> tuple[str, str]:
        """(id, name) of the experiment chosen by the user, else of the default one (created if needed)."""
        if self.chosen_experiment is not None:
            return self.chosen_experiment, str(client.get_experiment(self.chosen_experiment).name)
        if os.environ.get("MLFLOW_EXPERIMENT_NAME") or os.environ.get("MLFLOW_EXPERIMENT_ID"):
            experiment_id = _compat.experiment_id_from_env()
            return experiment_id, str(client.get_experiment(experiment_id).name)
        name = default_experiment_name()
        found = client.get_experiment_by_name(name)
        if found is None:
            root = sqlite_artifact_root(self.tracking_uri or "")
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or FALLBACK_EXPERIMENT
            try:
                return client.create_experiment(
                    name, artifact_location=None if root is None else Path(root, safe).as_uri()
                ), name
            except mlflow.exceptions.MlflowException:  # another kernel made it first
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise
        return found.experiment_id, name

    def capture(self, parent_run_id: str | None = None, experiment_id: str | None = None) -> None:
        """Read the calling thread's active MLflow run and experiment now (or take these): a background call's
        tracker starts on another thread, which has neither."""
        self.captured = True
        self.parent_run_id, self.chosen_experiment = parent_run_id, experiment_id
        if parent_run_id is None and experiment_id is None:
            self._read_active()

    def on_start(self, ctx: RunContext) -> None:
        # What only the calling thread can see (MLflow's active run and experiment are per thread) is
        # read here; the slow part (importing mlflow, creating the run) runs on a thread until worker_env().
        self.failure: BaseException | None = None
        if not self.captured:
            self.parent_run_id = self.chosen_experiment = None
            self._read_active()
        self.starting: threading.Thread | None = threading.Thread(
            target=self._start_quietly, args=(ctx,), name="air_magic-mlflow-run", daemon=True
        )
        self.starting.start()

    def _read_active(self) -> None:
        # Not imported yet (or being imported by prepare.py, which a user's import would have waited for):
        # the notebook cannot have an active run or experiment.
        if "mlflow" in sys.modules and not prepare.importing():
            from mlflow.tracking import fluent

            parent = fluent.active_run()
            if parent is not None:
                self.parent_run_id = parent.info.run_id
                self.chosen_experiment = parent.info.experiment_id
            else:
                self.chosen_experiment = _compat.active_experiment_id()

    def _start_quietly(self, ctx: RunContext) -> None:
        try:
            prepare.wait()  # the store's first set-up, if the extension started it, is done once
            # first: importing it sets its loggers' levels, which quiet_mlflow_logs overrides
            import mlflow  # noqa: F401

            with quiet_mlflow_logs():
                self._start(ctx)
        except BaseException as exc:  # noqa: BLE001 - reported on the calling thread by _started()
            self.run_id = None
            self.failure = exc

    def _started(self) -> None:
        """Wait for the run to exist; warn (on the calling thread) if it could not be made."""
        starting = getattr(self, "starting", None)
        if starting is None:
            return
        starting.join()
        self.starting = None
        exc = self.failure
        if exc is not None:  # an unreachable tracking server must not stop training
            warnings.warn(
                f"air_magic: MLflow tracking is off for this call because the run could not be created "
                f"({type(exc).__name__}: {exc}). Check MLFLOW_TRACKING_URI, or pass mlflow=False "
                f"(--no-mlflow for %%distributed) to run without MLflow.",
                RuntimeWarning,
                stacklevel=3,
            )

    def _start(self, ctx: RunContext) -> None:
        self._ctx = ctx
        import mlflow
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_SOURCE_NAME, MLFLOW_USER

        from . import ui

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
        if self.parent_run_id is not None and self.chosen_experiment is not None:
            experiment_id = self.chosen_experiment
            self.experiment_name = client.get_experiment(experiment_id).name
            tags[MLFLOW_PARENT_RUN_ID] = self.parent_run_id
        else:
            experiment_id, self.experiment_name = self._experiment(mlflow, client)
        self.experiment_id = experiment_id
        run = client.create_run(experiment_id, run_name=spec.name, tags=tags)
        run_id: str = run.info.run_id
        kind = spec.origin
        params = {
            kind: spec.name,
            "world_size": spec.world_size,
            "accelerator_type": spec.accelerator_type,
            "timeout": "none" if spec.timeout is None else f"{spec.timeout:g}",
        }
        if spec.num_nodes > 1:
            params["num_nodes"] = spec.num_nodes
        if spec.max_restarts:
            params["max_restarts"] = spec.max_restarts
        if spec.session is not None:
            params["session"] = spec.session
            if spec.ranks is not None:
                params["ranks"] = ",".join(map(str, spec.ranks))
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()], synchronous=True)
        self.run_id = run_id
        self.url = ui.run_url(self.tracking_uri, experiment_id, run_id)
        if self.url:
            ctx.links["mlflow"] = self.url

    def worker_hooks(self) -> list[str]:
        """The MLflow hook (hook.py) in every rank of a call that has a run."""
        self._started()
        return [HOOK] if self.run_id is not None else []

    @property
    def relayed(self) -> bool:
        """The ranks run on other machines and the store is a local file here: they relay through the launcher."""
        scheme = urlparse(self.tracking_uri or "").scheme
        return self.spec.num_nodes > 1 and scheme in ("sqlite", "file", "")

    def worker_env(self) -> dict[str, str]:
        self._started()
        if self.run_id is None or self.tracking_uri is None:
            return {}
        env = {
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MLFLOW_REGISTRY_URI": self.registry_uri or self.tracking_uri,  # spares a pyspark probe per call
            "MLFLOW_RUN_ID": self.run_id,
            "MLFLOW_EXPERIMENT_ID": str(self.experiment_id),
            "MLFLOW_EXPERIMENT_NAME": str(self.experiment_name),
            MLFLOW_RUN_ID: self.run_id,
        }
        for key, value in ASYNC_LOGGING_ENV.items():
            env[key] = os.environ.get(key, value)
        if self.relayed:
            from .relay import URI

            env.update({"MLFLOW_TRACKING_URI": URI, MLFLOW_RELAY: "1"})
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

        from ..launch.files.rundir import RunDir
        from .relay import decode_batch, read_batches

        assert self.run_id is not None and self._ctx is not None
        run_dir = RunDir(self._ctx.run_dir)
        for rank in range(self.spec.world_size):
            self._relayed[rank], lines = read_batches(run_dir.metrics(rank), self._relayed.get(rank, 0))
            for line in lines:
                try:
                    batch = decode_batch(line)
                    self.client.log_batch(
                        self.run_id,
                        metrics=[Metric(*m) for m in batch.metrics],
                        params=[Param(*p) for p in batch.params],
                        tags=[RunTag(*t) for t in batch.tags],
                        synchronous=True,
                    )
                except Exception as exc:  # noqa: BLE001 - one bad line (a param logged twice) must not stop the rest
                    self.relay_errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    # -- what the ranks use (fed by resources.ResourceSampler) --------------------
    def log_system_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one sample of the ranks' CPU, memory and GPU (`system/rank_N/...`) to the run; any thread may call it."""
        if getattr(self, "starting", True) is not None or self.run_id is None:
            return  # the run is still being made, or could not be
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()], synchronous=True
        )

    def on_attempt(self, attempt: int, why: str) -> None:
        """The call restarts in the same run: tag how many times (`air_magic.restarts`) and why each time."""
        self._started()
        if self.run_id is None:
            return
        with quiet_mlflow_logs():
            self.client.set_tag(self.run_id, "air_magic.restarts", str(attempt), synchronous=True)
            self.client.set_tag(self.run_id, f"air_magic.attempt_{attempt}_failure", why[:5000], synchronous=True)

    # -- on end ------------------------------------------------------------
    def on_end(self, result: JobResult) -> None:
        self._started()
        if self.run_id is None:
            return
        with quiet_mlflow_logs():
            self._end(result)

    def _end(self, result: JobResult) -> None:
        run_id = self.run_id
        assert run_id is not None
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
                    self.client.log_artifact(run_id, str(rank.log_path), artifact_path="logs")
            profile = result.profile  # profile=N: each rank's trace and the merged one
            for trace in [] if profile is None else [*profile.traces, *([profile.trace] if profile.trace else [])]:
                self.client.log_artifact(run_id, str(trace), artifact_path="profile")
            for i, alert in enumerate(result.alerts[:20]):  # what the watch saw: stragglers, hangs, fatal lines
                self.client.set_tag(run_id, f"air_magic.call_alert_{i}", f"{alert.kind}: {alert.message}"[:5000])
            for rank in result.ranks:  # GPU ranks: the peak torch counted, the snapshot an out-of-memory error left
                if rank.gpu_peak_allocated is not None:
                    name = f"memory/rank_{rank.rank}/peak_allocated_gib"
                    self.client.log_metric(run_id, name, rank.gpu_peak_allocated / 2**30)
                snapshot = RunDir(result.run_dir).memory_snapshot(rank.rank)
                if snapshot.exists():
                    self.client.log_artifact(run_id, str(snapshot), artifact_path="memory")
        except Exception as exc:  # noqa: BLE001 - the call's own outcome matters more than its logs
            warnings.warn(
                f"air_magic could not store the rank logs in MLflow run {self.run_id}: {exc!r}. "
                f"They are still in {result.run_dir}.",
                RuntimeWarning,
                stacklevel=4,
            )
        finally:
            self.client.set_terminated(run_id, result.status.value)


def make_tracker(spec: JobSpec) -> Listener | None:
    """The MLflow listener for `spec`, or None when MLflow is off."""
    if not spec.mlflow:
        return None
    return MlflowTracker(spec)
