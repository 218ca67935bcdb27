"""`python -m air_magic.owner.detached RUN_DIR`: a detached call's owner process, an owner like a kernel.

The call's hand-off and its end are calls/detached.py's; this entry point gives that process its one owner (with the
role its starter named: "detached" from a notebook, "cli" from the command line), whose door the call goes through.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..calls.detached import main
from ..job import JobSpec
from ..listeners import Listener
from .listeners import captured, default_listeners
from .owner import owner


def submit_as(role: str) -> Callable[..., Any]:
    """This process's owner, in `role`, and its one door."""
    return owner(role).submit


def listeners_for(spec: JobSpec, hand_off: dict[str, Any]) -> list[Listener]:
    """The call's listeners, its MLflow run made in the experiment (or under the parent run) its starter had."""
    experiment_id = hand_off["experiment_id"]
    if hand_off["experiment_name"] and spec.mlflow:
        import mlflow

        experiment_id = mlflow.set_experiment(hand_off["experiment_name"]).experiment_id
    listeners = default_listeners(spec)
    if experiment_id or hand_off["parent_run_id"]:
        captured(listeners, hand_off["parent_run_id"], experiment_id)
    return listeners


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], submit_as, listeners_for))
