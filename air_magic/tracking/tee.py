"""The live-chart copy of a rank's logged metrics: one JSON line per value, its writer and its reader.

In a rank, the MLflow hook (hook.py) hands every value of `mlflow.log_metric(s)`
to a `TeeWriter`, which appends `{"key": ..., "value": ..., "step": ..., "ts": ...}`
lines to the rank's `RunDir.chart_metrics` file (mode 0600); in the notebook
the display's charts read them back with `decode` without asking the tracking
server anything. Lines are written whole, one `os.write` per logging call, so
a reader sees a line only once it is complete (up to its newline). Imports
nothing of MLflow.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple


class Point(NamedTuple):
    """One logged value as the charts see it."""

    key: str
    value: float
    step: float | None  # None: the value was logged without a step
    ts: float


class TeeWriter:
    """Appends logged values to one rank's chart file; never raises (the metric itself was logged)."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._prefixes: dict[Any, str] = {}  # the JSON text before each key's value, made once per key

    def encode(self, key: Any, value: Any, step: Any, now: float) -> str:
        """One line; `key` is written as its str(), `value` as a float, `step` as an int or null."""
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = '{"key":' + json.dumps(str(key)) + ',"value":'
        return f'{prefix}{float(value)!r},"step":{"null" if step is None else int(step)},"ts":{now!r}}}\n'

    def write(self, items: Iterable[tuple[Any, Any, Any]]) -> None:
        """Append (key, value, step) items, stamped with the time now, in one write."""
        try:
            now = time.time()
            data = "".join(self.encode(k, v, s, now) for k, v, s in items).encode()
            with self._lock:  # one os.write per call: lines of two threads never mix
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                os.write(self._fd, data)
        except (OSError, TypeError, ValueError, OverflowError):
            pass  # the charts are a convenience; the metric itself was logged

    def close(self) -> None:
        """Close the file (a later write opens it again)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def decode(line: bytes | str) -> Point | None:
    """The value one complete line holds, or None for a line that is not one (or not a finite number)."""
    try:
        item = json.loads(line)
        key, value = str(item["key"]), float(item["value"])
        step = item.get("step")
        ts = float(item.get("ts") or 0.0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not math.isfinite(value):
        return None
    return Point(key, value, float(step) if isinstance(step, (int, float)) else None, ts)
