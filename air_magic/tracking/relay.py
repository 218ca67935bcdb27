"""Inside a rank on another machine: an MLflow tracking store that relays what the rank logs to the notebook.

When the call's store is a local file on the notebook's machine (MLflow's
default sqlite, or a file store) and the ranks run on other machines (the
Ray launcher), the ranks cannot open it, and nothing should listen beyond
loopback on the notebook's machine for them. So their tracking URI is
`air-magic-relay:` and this store writes each `log_metric` / `log_param` /
`set_tag` / `log_batch` as one JSON line to the rank's relay file
(`RunDir.metrics`). The launcher carries that file back with the rank's
output, and the notebook's MLflow listener (listener.py) reads it back with
`read_batches` and logs every batch to the call's run. Artifacts are not
relayed: the rank's log is stored as an artifact by the notebook; other
files need a store both machines reach.

The line format, writer (`encode_batch`) and reader (`decode_batch`), is
plain JSON and lives here alone. Importing this module imports MLflow (the
store is one of MLflow's); the rank's hook (hook.py) imports it only once
the user's code has imported mlflow, the notebook only for a relayed call.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.entities import LifecycleStage, Run, RunData, RunInfo, RunStatus
from mlflow.store.tracking.abstract_store import AbstractStore

from ..envvars import INTERNAL_RUN_DIR
from ..launch.files.rundir import RunDir
from . import _compat

SCHEME = "air-magic-relay"
URI = f"{SCHEME}:"


@dataclass
class Batch:
    """What one logging call sent: metrics as (key, value, timestamp ms, step), params and tags as (key, value)."""

    metrics: list[tuple[str, float, int, int]] = field(default_factory=list)
    params: list[tuple[str, str]] = field(default_factory=list)
    tags: list[tuple[str, str]] = field(default_factory=list)


def encode_batch(metrics: Iterable[Any], params: Iterable[Any], tags: Iterable[Any]) -> bytes:
    """One line for MLflow entities (Metric, Param, RunTag, or anything with the same attributes)."""
    return (
        json.dumps(
            {
                "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics],
                "params": [[p.key, p.value] for p in params],
                "tags": [[t.key, t.value] for t in tags],
            }
        )
        + "\n"
    ).encode()


def decode_batch(line: bytes) -> Batch:
    """The batch one line holds; raises ValueError (or KeyError, TypeError) for a line that is not one."""
    record = json.loads(line)
    return Batch(
        metrics=[(str(k), float(v), int(t), int(s)) for k, v, t, s in record.get("metrics", ())],
        params=[(str(k), str(v)) for k, v in record.get("params", ())],
        tags=[(str(k), str(v)) for k, v in record.get("tags", ())],
    )


def read_batches(path: Path, offset: int) -> tuple[int, list[bytes]]:
    """The complete lines written to `path` after byte `offset`, and the offset after them.

    A line still being written (no newline yet) is left for the next read; a missing file has no lines.
    """
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset, []
    complete = data[: data.rfind(b"\n") + 1]
    return offset + len(complete), complete.splitlines()


class RelayStore(AbstractStore):
    """Appends what is logged to the relay file of the call running now, as JSON lines.

    MLflow keeps one store per tracking URI for the life of the process, so a hot rank's later calls find
    this one: the file (the call's run directory and rank) and the experiment are read from the environment
    each call sets, never kept from the first call.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    @property
    def path(self) -> Path:
        return RunDir(Path(os.environ[INTERNAL_RUN_DIR])).metrics(int(os.environ.get("RANK", "0")))

    @property
    def experiment_id(self) -> str:
        return os.environ.get("MLFLOW_EXPERIMENT_ID", "")

    def _write(self, line: bytes) -> None:
        with self.lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def get_run(self, run_id: str) -> Run:
        info = RunInfo(
            run_id=run_id,
            experiment_id=self.experiment_id,
            user_id="",
            status=RunStatus.to_string(RunStatus.RUNNING),
            start_time=int(time.time() * 1000),
            end_time=None,
            lifecycle_stage=LifecycleStage.ACTIVE,
        )
        return Run(info, RunData())

    def update_run_info(self, run_id: str, run_status: Any, end_time: Any, run_name: Any) -> RunInfo:
        return self.get_run(run_id).info  # the notebook owns the run's status

    def log_batch(self, run_id: str, metrics: Any, params: Any, tags: Any) -> None:
        self._write(encode_batch(metrics or (), params or (), tags or ()))

    def log_metric(self, run_id: str, metric: Any) -> None:
        self.log_batch(run_id, [metric], [], [])

    def log_param(self, run_id: str, param: Any) -> None:
        self.log_batch(run_id, [], [param], [])

    def set_tag(self, run_id: str, tag: Any) -> None:
        self.log_batch(run_id, [], [], [tag])


def register() -> None:
    """Make `air-magic-relay:` a tracking URI of this process, writing to the relay file of the call running."""
    store = RelayStore()  # type: ignore[abstract]  # only what a rank logs to its run is needed
    _compat.register_tracking_store(SCHEME, lambda store_uri=None, artifact_uri=None: store)
