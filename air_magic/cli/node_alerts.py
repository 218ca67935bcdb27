"""The alerts of one node's attempt of a command run: what a line of its log raises, and where each alert is kept.

A fatal line of the command's output (watching/fatal_lines.py: CUDA out of memory, NCCL's watchdog, a segfault...)
and a line of the node's watch (cli/command_watch.py: `air-magic: watch: <kind>: <message>`) are alerts. `NodeAlerts`
keeps each as a line of the run's `alerts.jsonl` (what `get` reads; a node of another machine's come back with its
files, launch/files/node_mirror.py) and in memory for the attempt's MLflow tags (cli/node_mlflow.py); `alert_kind`
is how `--watch` and `-o json` (cli/watch.py, cli/events.py) know an ALERT line.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from ..launch.files.command_logs import WATCH_PREFIX
from ..watching.fatal_lines import kind_of

#: Alerts of one attempt that become tags of its MLflow run, at most.
TAGGED = 20


def alert_kind(line: str) -> str | None:
    """The alert a line of a node's log raises: a watch alert's kind (straggler, hang), a fatal line's, or None."""
    if line.startswith(WATCH_PREFIX):
        kind, sep, _ = line[len(WATCH_PREFIX) :].partition(": ")
        if sep and kind.isidentifier():
            return kind
    return kind_of(line)


class NodeAlerts:
    """The alerts of one node's attempt: each a line of `alerts.jsonl`, kept for the MLflow run's tags (`raised`)."""

    def __init__(self, path: Path, attempt: int, node: int) -> None:
        self.path, self.attempt, self.node = path, attempt, node
        self.raised: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None

    def add(self, kind: str, line: str, rank: int | None = None) -> None:
        alert: dict[str, Any] = {"attempt": self.attempt, "node": self.node, "kind": kind, "line": line}
        if rank is not None:
            alert["rank"] = rank
        with self._lock:
            self.raised.append(alert)
            if self._file is None:
                self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for the attempt; close() ends it
            self._file.write((json.dumps({**alert, "time": time.time()}) + "\n").encode())
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
