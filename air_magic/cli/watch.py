"""Following a call from a terminal: every rank's lines as they come, prefixed by rank, and a status line.

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
from .mlflow_ui import follow_link

#: Seconds between two looks at the logs and the record.
LOOK = 0.2


class _Lines:
    """Whole lines of each rank, prefixed by its rank; a line still being written waits for its end."""

    def __init__(self, world_size: int) -> None:
        self.partial = [""] * world_size

    def feed(self, rank: int, text: str) -> list[str]:
        *lines, self.partial[rank] = (self.partial[rank] + text).split("\n")
        return [f"[rank {rank}] {line}" for line in lines]

    def rest(self) -> list[str]:
        return [f"[rank {rank}] {text}" for rank, text in enumerate(self.partial) if text]


def status_line(record: dict[str, Any]) -> str:
    elapsed = (record.get("ended") or time.time()) - (record.get("started") or time.time())
    status = record.get("status", "?")
    if status == call_record.WAITING and record.get("waiting_for"):
        status += f" for {record['waiting_for']}"
    return (
        f"{record.get('name')} · {record['id']} · {status} · {record.get('world_size')} rank(s) "
        f"{record.get('accelerator_type')} · {elapsed:.0f} s"
    )


def follow(
    path: Path, out: TextIO | None = None, ending: Callable[[dict[str, Any]], list[str]] | None = None
) -> dict[str, Any]:
    """Print the call's output live until it ends, then `ending(record)`'s lines and the status line; its final
    record."""
    out = out or sys.stdout
    record = call_record.load(path) or {}
    reader = LogReader(path, int(record.get("world_size", 1)))
    lines = _Lines(int(record.get("world_size", 1)))
    live: Any = None
    if out.isatty():
        from rich.console import Console

        console = Console(file=out, highlight=False, markup=False)
        live = console.status(status_line(record))
        live.start()

    def emit(text: str) -> None:
        if live is not None:
            console.print(text)
        else:
            print(text, file=out, flush=True)

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
                        emit(line)
                if live is not None:
                    live.update(status_line(record))
                elif record.get("status") != said and record.get("status") in call_record.LIVE:
                    said = str(record.get("status"))
                    emit(f"air-magic: {status_line(record)}")
                if record.get("status") not in call_record.LIVE:
                    break
                time.sleep(LOOK)
            except KeyboardInterrupt:
                if cancelled:
                    raise
                cancelled = True
                call_record.request_cancel(path)
                emit(f"air-magic: cancelling {path.name} (Ctrl-C again to stop following; the call is cancelled)")
        for rank, text in sorted(reader.read().items()):
            for line in lines.feed(rank, text):
                emit(line)
        for line in lines.rest():
            emit(line)
    finally:
        if live is not None:
            live.stop()
    for line in ending(record) if ending is not None else []:  # how it failed, before the last status line
        print(line, file=out)
    print(f"air-magic: {status_line(record)}", file=out, flush=True)
    return record
