"""The files a workload run keeps in its run directory, named once: what `run` writes before the call starts
(the file as run, `command.sh`, `hyperparameters.yaml`, the code snapshot, `workload.json`) and what each node
writes per attempt (its log, how it ended, its alerts, the directory of its command's ranks' files). Not for: the
call's own files (launch/files/rundir.py, calls/record.py), the ranks' files themselves (cli/command_rank.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..launch.files import command_logs
from ..launch.files.rundir import write_private


class WorkloadDir:
    """The workload's files in the call's run directory `path`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def config(self) -> Path:
        """The workload file as run (overrides applied)."""
        return self.path / "training_config.yaml"

    @property
    def command(self) -> Path:
        return self.path / "command.sh"

    @property
    def hyperparameters(self) -> Path:
        return self.path / "hyperparameters.yaml"

    @property
    def code_source(self) -> Path:
        """The directory the snapshot is copied into (the code is in a directory named as root_path's)."""
        return self.path / "code_source"

    @property
    def info(self) -> Path:
        """What `get` and `list` read: experiment, topology, max_retries, idempotency token."""
        return self.path / command_logs.INFO

    @property
    def install_log(self) -> Path:
        """pip's output of the cached environment the workload's missing dependencies went into (cli/layer.py)."""
        return self.path / "install.log"

    @property
    def alerts(self) -> Path:
        return self.path / command_logs.ALERTS

    def attempt(self, attempt: int) -> Path:
        return command_logs.attempt_dir(self.path, attempt)

    def node_log(self, attempt: int, node: int) -> Path:
        return self.attempt(attempt) / f"node_{node}.log"

    def rank_dir(self, attempt: int, node: int) -> Path:
        """The files of the ranks that node `node`'s command started in attempt `attempt` (cli/command_rank.py)."""
        return command_logs.node_dir(self.path, attempt, node)

    def rank_dirs(self, attempt: int) -> list[Path]:
        """Every node's directory of rank files of attempt `attempt` kept here."""
        return sorted(self.attempt(attempt).glob("node_*/"))

    def command_ranks(self, attempt: int) -> dict[int, Path]:
        """The ranks the command's launcher started in attempt `attempt`, kept here: global RANK -> its node's
        directory of rank files."""
        return {rank: log.parent for rank, log in command_logs.rank_logs(self.path, attempt).items()}

    def node_end(self, attempt: int, node: int) -> Path:
        return self.attempt(attempt) / f"node_{node}.json"

    def attempts(self) -> list[int]:
        """The attempts that started, in order (0 the first)."""
        return command_logs.attempts(self.path)

    @property
    def per_node(self) -> int:
        """Ranks per node of a command run (its first rank on each node runs the command); 1 for a function run,
        whose every rank is shown."""
        info = self.read_info() or {}
        return int(info.get("per_node") or 1) if info.get("kind") == "command" else 1

    def unit_of(self, rank: int) -> int | None:
        """What rank `rank`'s log is shown as: the node whose command it ran (a command run's first rank of each
        node), the rank itself (a function run), or None (a rank that only holds its node's units)."""
        per_node = self.per_node
        return rank // per_node if rank % per_node == 0 else None

    def read_info(self) -> dict[str, Any] | None:
        return command_logs.info(self.path) or None

    def write_info(self, info: dict[str, Any]) -> None:
        write_private(self.info, json.dumps(info).encode())

    def read_end(self, attempt: int, node: int) -> dict[str, Any]:
        try:
            value = json.loads(self.node_end(attempt, node).read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def read_alerts(self) -> list[dict[str, Any]]:
        return command_logs.alerts(self.path)
