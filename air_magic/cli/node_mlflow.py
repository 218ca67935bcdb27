"""The MLflow run of a command run's attempt, on its node (cli/node.py): a new run for each retry, as the runtime
makes one per attempt; the watch's metrics of the node's ranks logged to it; the attempt's alerts as its tags. Every
part is best effort: MLflow is a copy of what the run directory keeps, and a node whose MLflow fails runs on. Not for:
the notebook's tracking of a call (tracking/).
"""

from __future__ import annotations

import time
from typing import Any

from .node_alerts import TAGGED


def attempt_run(env: dict[str, str], name: str, attempt: int) -> Any:
    """A new MLflow run for attempt `attempt` (> 0) in the call's experiment, as the runtime makes one per
    attempt; None if there is no run to follow."""
    if attempt == 0 or not env.get("MLFLOW_RUN_ID") or not env.get("MLFLOW_EXPERIMENT_ID"):
        return None
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        run = client.create_run(
            env["MLFLOW_EXPERIMENT_ID"],
            run_name=name,
            tags={"air_magic.attempt": str(attempt), "air_magic.first_attempt_run": env["MLFLOW_RUN_ID"]},
        )
        return client, run.info.run_id
    except Exception as exc:  # noqa: BLE001 - the attempt runs on; its metrics go to the first attempt's run
        print(f"air-magic: attempt {attempt} logs to the first attempt's MLflow run: {exc}", flush=True)
        return None


def metrics_sink(env: dict[str, str]) -> Any:
    """What logs the watch's metrics of this node's ranks to the attempt's MLflow run; None without a run."""
    if not env.get("MLFLOW_RUN_ID"):
        return None
    run_id = env["MLFLOW_RUN_ID"]
    client: list[Any] = []

    def log(values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        if not client:
            client.append(MlflowClient(env.get("MLFLOW_TRACKING_URI")))
        now = int(time.time() * 1000)
        client[0].log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()], synchronous=True)

    return log


def tag_alerts(env: dict[str, str], raised: list[dict[str, Any]]) -> None:
    """The attempt's alerts as tags of its MLflow run (`air_magic.alert_<i>`: kind, node and line), best effort."""
    if not env.get("MLFLOW_RUN_ID"):
        return
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        for i, alert in enumerate(raised[:TAGGED]):
            text = f"{alert['kind']} on node {alert['node']}: {alert['line']}"[:5000]
            client.set_tag(env["MLFLOW_RUN_ID"], f"air_magic.alert_{i}", text)
    except Exception as exc:  # noqa: BLE001 - the alerts stay in the run directory; MLflow is a copy
        print(f"air-magic: the alerts were not tagged on the MLflow run: {exc}", flush=True)
