"""A call whose owner died (a kernel's SIGKILL, a killed detached owner) leaves its MLflow run RUNNING: the first
process that finds it so (calls/record.py's `load`, in any kernel or `air-magic` process) ends that run FAILED, with
a tag naming the owner that died. Not for: a call whose owner is alive (its tracking listener ends the run)."""

from __future__ import annotations

from typing import Any

#: The tag saying why the run was ended by a process other than its owner.
ENDED_BY = "air_magic.ended_by"


def fail_run(record: dict[str, Any]) -> None:
    """End the MLflow run of the orphaned call `record` FAILED, if it is still running in its store."""
    run_id, uri = record.get("run_id"), record.get("tracking_uri")
    if not run_id or not uri:
        return
    from mlflow import MlflowClient

    from .store import quiet_mlflow_logs

    with quiet_mlflow_logs():
        client = MlflowClient(str(uri))
        if client.get_run(str(run_id)).info.status != "RUNNING":
            return
        client.set_tag(str(run_id), ENDED_BY, str(record.get("error") or "its owner died"))
        client.set_terminated(str(run_id), "FAILED")
