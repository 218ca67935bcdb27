"""The fatal lines of a rank's or a node's output: the patterns the runtime raises an alert for, each with its kind.

`kind_of(line)` is the alert kind of an output line (`oom`, `nccl`, `cuda`, `xid`, `segfault`, `killed`, `store`,
`command_not_found`, `script_failed`, `framework`, `mlflow`), or None for an ordinary line. `FatalLines`, a
listener of every call, raises an `Alert` for each rank's first line of each kind: `handle.alerts`, the panel's
alert lines and the rank's tab badge, the text display, the call's record and MLflow tags show it. The node that
runs a workload's command (cli/node.py) records each line's alert with the run; `--watch` and `logs` show them,
and `-o json` writes an `ALERT` event before the line. Not for: stragglers and hangs (detector.py), which are
found from the ranks' steps, not their lines.
"""

from __future__ import annotations

import re
import time

from ..job import Alert
from ..listeners import Listener, RunContext

_I = re.IGNORECASE

#: (kind, pattern), first match wins.
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("oom", re.compile(r"CUDA out of memory", _I)),
    ("oom", re.compile(r"Out of memory: Kill(ed)? process", _I)),
    ("oom", re.compile(r"composer.*OutOfMemory", _I)),
    ("killed", re.compile(r"signal\s+(9|SIGKILL|SIGTERM)", _I)),
    ("killed", re.compile(r"^\s*Killed\s*$")),
    ("nccl", re.compile(r"Watchdog caught collective operation timeout")),
    ("nccl", re.compile(r"NCCL WARN .*(Conn|Net|IB|timeout|unhandled)", _I)),
    ("nccl", re.compile(r"Got async error event")),
    ("nccl", re.compile(r"transport/net_ib\.cc:\d+.*WARN")),
    ("cuda", re.compile(r"CUDA( runtime)? error", _I)),
    ("cuda", re.compile(r"an illegal memory access was encountered", _I)),
    ("cuda", re.compile(r"CUDA kernel errors might be asynchronously reported")),
    ("segfault", re.compile(r"segmentation fault", _I)),
    ("xid", re.compile(r"Xid.*\b(48|63|64|79|94|95)\b")),
    ("store", re.compile(r"(TCPStore|Store).*timed?\s*out", _I)),
    ("store", re.compile(r"torch\.distributed\..*(Error|Exception)")),
    ("framework", re.compile(r"composer\.utils\..*Error")),
    ("framework", re.compile(r"streaming\.base\..*(Error|Exception)")),
    ("mlflow", re.compile(r"\[MLflow Logger\]\[Warning\] No new logs have been emitted")),
    ("command_not_found", re.compile(r"command not found", _I)),
    ("script_failed", re.compile(r"ERROR: Script failed with exit code [1-9]\d* after \d+s")),
)

#: The kinds, in the order above, once each.
KINDS = tuple(dict.fromkeys(kind for kind, _ in PATTERNS))


#: A word every pattern needs (case aside): a line without any is ordinary, read with one search instead of all
#: of PATTERNS (every output line of every rank is read, a flood's millions included).
_HINT = re.compile(
    r"memory|kill|signal|watchdog|nccl|async error|net_ib|cuda|segmentation|xid|store|torch\.distributed|composer"
    r"|streaming|mlflow|command not found|script failed",
    _I,
)


def kind_of(line: str) -> str | None:
    """The alert kind of `line`, or None."""
    if not _HINT.search(line):
        return None
    for kind, pattern in PATTERNS:
        if pattern.search(line):
            return kind
    return None


#: Alerts one call raises from its ranks' lines at most (one per rank and kind).
MAX_ALERTS = 20
#: Characters of the fatal line an alert quotes.
QUOTED = 300


class FatalLines(Listener):
    """Raises an alert for each rank's first output line of each fatal kind (see the module)."""

    def __init__(self) -> None:
        self.ctx: RunContext | None = None
        self.partial: dict[int, str] = {}
        self.seen: set[tuple[int, str]] = set()

    def on_start(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def on_output(self, rank: int, text: str) -> None:
        lines = (self.partial.pop(rank, "") + text).split("\n")
        self.partial[rank] = lines.pop()[-4096:]  # a line still being written (bounded: a bar without newlines)
        for line in lines:
            self._look(rank, line)

    def on_end(self, result: object) -> None:
        for rank, line in list(self.partial.items()):
            self._look(rank, line)
        self.partial.clear()

    def _look(self, rank: int, line: str) -> None:
        kind = kind_of(line)
        if kind is None or (rank, kind) in self.seen or self.ctx is None or len(self.seen) >= MAX_ALERTS:
            return
        self.seen.add((rank, kind))
        quoted = line.strip()[:QUOTED]
        self.ctx.alerts.append(Alert(kind, rank, "output", f"rank {rank}: {kind}: {quoted}", time.time()))
