"""A run followed as the runtime's JSON lines, for scripts and coding agents: `run --watch -o json` and
`logs --follow -o json`.

`follow_json(path, out)` writes `SUBMITTED` (when asked), a `STATUS` line at each change of state, a `LOG` line
per line of each node's log (an `ALERT` line first when it matches a fatal pattern, watching/fatal_lines.py, or is
the watch's, cli/command_watch.py), and at the end the envelope of the run's final state. `log_events(node, text)`
gives the events of a finished log. Not for: the text a person reads (cli/watch.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from ..calls import record as call_record
from ..display.follow import LogReader
from .files import WorkloadDir
from .node_alerts import alert_kind
from .output import envelope, event, run_fields, state
from .watch import LOOK, Lines


def log_events(node: int, text: str) -> Iterator[str]:
    """The ALERT and LOG lines of `text`, one node's log."""
    for line in text.splitlines():
        kind = alert_kind(line)
        if kind is not None:
            yield event("ALERT", node=node, kind=kind, line=line)
        yield event("LOG", node=node, line=line)


def follow_json(path: Path, out: TextIO, submitted: bool = False) -> dict[str, Any]:
    """Write the run's events until it ends, then the envelope of its final state; its final record."""

    def write(text: str) -> None:
        print(text, file=out, flush=True)

    record = call_record.load(path) or {}
    if submitted:
        write(event("SUBMITTED", run_id=path.name, dashboard_url=record.get("link")))
    world = int(record.get("world_size", 1))
    reader, lines, files = LogReader(path, world), Lines(world), WorkloadDir(path)
    said: str | None = None
    while True:
        record = call_record.load(path) or record
        now = state(path, record)
        if now != said:
            write(event("STATUS", status=now, previous_status=said))
            said = now
        ended = record.get("status") not in call_record.LIVE
        chunks = reader.read(final=ended)
        while chunks:  # once it ended, every line left in the logs
            for rank, text in sorted(chunks.items()):
                unit = files.unit_of(rank)
                for line in lines.feed(rank, text):
                    for item in log_events(unit, line + "\n") if unit is not None else ():
                        write(item)
            chunks = reader.read(final=True) if ended else {}
        if ended:
            break
        time.sleep(LOOK)
    for rank, rest in lines.rest():
        unit = files.unit_of(rank)
        for item in log_events(unit, rest) if unit is not None else ():
            write(item)
    write(envelope(run_fields(path, record)))
    return record
