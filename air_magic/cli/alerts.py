"""The fatal lines of a node's log: the patterns the runtime raises an alert for, each with its kind.

`kind_of(line)` is the alert kind of a log line (`oom`, `nccl`, `cuda`, `xid`, `segfault`, `killed`, `store`,
`command_not_found`, `script_failed`, `framework`, `mlflow`), or None for an ordinary line. The node that runs
the command (cli/node.py) records each alert with the call; `--watch` and `logs` show them, and `-o json`
writes an `ALERT` event before the line. Not for: stragglers and hangs (watching/), which are found from the
ranks' steps, not their lines.
"""

from __future__ import annotations

import re

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


def kind_of(line: str) -> str | None:
    """The alert kind of `line`, or None."""
    for kind, pattern in PATTERNS:
        if pattern.search(line):
            return kind
    return None
