"""Following a call from a terminal: every rank's lines as they come, prefixed by rank (by node, for a command
workload, whose command runs once per node), an `ALERT` line after a fatal one or the watch's (cli/command_watch.py),
and a status line with the runtime's state (cli/output.py).

`follow(path)` reads the ranks' logs in the run directory from their first byte (display/follow.py's
`LogReader`, as a notebook's panel drawn again does) and the call's live record (calls/record.py) until the
call ends, and returns its status, with the link to its MLflow run once it has one. On a terminal the status
line is drawn by `rich` under the lines; when the output is not a terminal, plain lines only (a status line
each time the status changes). Ctrl-C asks the call's owner to cancel it, and the following goes on to its
end. Not for: the notebook's panel.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ..calls import record as call_record
from ..display.follow import LogReader
from .files import WorkloadDir
from .mlflow_ui import follow_link
from .node_alerts import alert_kind
from .output import state
from .prompts import RunPrompts

#: Seconds between two looks at the logs and the record.
LOOK = 0.2


class Lines:
    """Whole lines of each rank (a node's, for a command workload), and the line still being written of each."""

    def __init__(self, world_size: int) -> None:
        self.partial = [""] * world_size

    def feed(self, rank: int, text: str) -> list[str]:
        *lines, self.partial[rank] = (self.partial[rank] + text).split("\n")
        return lines

    def rest(self) -> list[tuple[int, str]]:
        return [(rank, text) for rank, text in enumerate(self.partial) if text]


def status_line(record: dict[str, Any], path: Path | None = None) -> str:
    elapsed = (record.get("ended") or time.time()) - (record.get("started") or time.time())
    status = state(path, record) if path is not None else record.get("status", "?")
    if record.get("status") == call_record.WAITING and record.get("waiting_for"):
        status += f" for {record['waiting_for']}"
    what = f"{record.get('world_size')} rank(s) {record.get('accelerator_type')}"
    info = WorkloadDir(path).read_info() if path is not None else None
    if info and info.get("kind") == "command":
        what = f"{info['num_nodes']} node(s) of {info.get('per_node')} x {info['accelerator_type']}"
    return f"{record.get('name')} · {record['id']} · {status} · {what} · {elapsed:.0f} s"


def follow(
    path: Path,
    out: TextIO | None = None,
    ending: Callable[[dict[str, Any]], list[str]] | None = None,
    prompts: bool = False,
) -> dict[str, Any]:
    """Print the call's output live until it ends, then `ending(record)`'s lines and the status line; its final
    record. With `prompts`, a rank waiting at a debugger prompt is answered from standard input (cli/prompts.py)."""
    out = out or sys.stdout
    record = call_record.load(path) or {}
    reader = LogReader(path, int(record.get("world_size", 1)))
    lines = Lines(int(record.get("world_size", 1)))
    files = WorkloadDir(path)
    label = "node" if (files.read_info() or {}).get("kind") == "command" else "rank"
    live: Any = None
    if out.isatty():
        from rich.console import Console

        console = Console(file=out, highlight=False, markup=False)
        live = console.status(status_line(record, path))
        live.start()

    def emit(text: str) -> None:
        if live is not None:
            console.print(text)
        else:
            print(text, file=out, flush=True)

    def emit_line(rank: int, text: str) -> None:
        unit = files.unit_of(rank)
        if unit is None:  # a rank that only holds its node's units: the node's lines are its first rank's
            return
        emit(f"[{label} {unit}] {text}")
        kind = alert_kind(text)
        if kind is not None:
            emit(f"air-magic: ALERT {kind} on {label} {unit}: {text.strip()}")

    answering = RunPrompts(path, int(record.get("world_size", 1))) if prompts else None
    said = ""
    linked = False
    cancelled = False
    try:
        while True:
            try:
                record = call_record.load(path) or record
                if not linked and record.get("run_id"):
                    linked = True
                    link = follow_link(record)  # served by this process while it follows (cli/mlflow_ui.py)
                    if link:
                        emit(f"air-magic: MLflow run: {link}")
                for rank, text in sorted(reader.read().items()):
                    for line in lines.feed(rank, text):
                        emit_line(rank, line)
                answered = answering is not None and answering.serve(pause=live.stop if live is not None else None)
                if answered and live is not None:
                    live.start()  # the status line again, once the prompts are answered
                if live is not None:
                    live.update(status_line(record, path))
                elif record.get("status") != said and record.get("status") in call_record.LIVE:
                    said = str(record.get("status"))
                    emit(f"air-magic: {status_line(record, path)}")
                if record.get("status") not in call_record.LIVE:
                    break
                time.sleep(LOOK)
            except KeyboardInterrupt:
                if cancelled:
                    raise
                cancelled = True
                call_record.request_cancel(path)
                emit(f"air-magic: cancelling {path.name} (Ctrl-C again to stop following; the call is cancelled)")
        chunks = reader.read(final=True)
        while chunks:  # every line left in the logs, however long
            for rank, text in sorted(chunks.items()):
                for line in lines.feed(rank, text):
                    emit_line(rank, line)
            chunks = reader.read(final=True)
        for rank, line in lines.rest():
            emit_line(rank, line)
    finally:
        if live is not None:
            live.stop()
    for line in ending(record) if ending is not None else []:  # how it failed, before the last status line
        print(line, file=out)
    print(f"air-magic: {status_line(record, path)}", file=out, flush=True)
    return record
