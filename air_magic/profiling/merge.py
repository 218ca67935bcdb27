"""Every rank's trace in one Chrome/Perfetto JSON file: one process per rank, clocks aligned.

Each rank's events keep their threads, names and arguments; their process id
becomes the rank (named "rank N", sorted by rank), their times one timeline
(microseconds since the earliest event of any rank, each rank's clock offset
applied: analysis.align), and the ids that link a CPU launch to its GPU kernel
(flow events, correlation ids) are made unique per rank. The file opens in
https://ui.perfetto.dev and chrome://tracing. Not for reading a trace (analysis.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .analysis import RankTrace

#: Bits a rank's ids are shifted by, so that two ranks' flow ids never meet.
ID_SHIFT = 40


def merged_events(traces: list[RankTrace]) -> list[dict[str, Any]]:
    """The events of every rank on one timeline, a process per rank (see the module)."""
    out: list[dict[str, Any]] = []
    # in small numbers: epoch microseconds as floats keep only a quarter of a microsecond
    first_ns = min((t.base_ns for t in traces), default=0)
    starts = {t.rank: (t.base_ns - first_ns) / 1000 + t.offset for t in traces}
    zero = min((starts[t.rank] + min(float(e["ts"]) for e in t.events) for t in traces if t.events), default=0.0)
    for trace in traces:
        raw = json.loads(trace.path.read_bytes())
        shift = starts[trace.rank] - zero
        out.append(
            {"ph": "M", "name": "process_name", "pid": trace.rank, "tid": 0, "args": {"name": f"rank {trace.rank}"}}
        )
        out.append(
            {"ph": "M", "name": "process_sort_index", "pid": trace.rank, "tid": 0, "args": {"sort_index": trace.rank}}
        )
        for e in raw.get("traceEvents", []):
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue
            event = {**e, "pid": trace.rank}
            if isinstance(e.get("ts"), (int, float)):
                event["ts"] = round(float(e["ts"]) + shift, 3)
            if isinstance(e.get("id"), int):
                event["id"] = e["id"] + (trace.rank << ID_SHIFT)
            out.append(event)
    return out


def write(traces: list[RankTrace], path: Path) -> int:
    """Write the merged trace to `path` (0600); its size in bytes."""
    data = json.dumps({"traceEvents": merged_events(traces), "displayTimeUnit": "ms"}, separators=(",", ":")).encode()
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)
