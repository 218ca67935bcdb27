"""A rank's step times and what it is doing now: `rank-N.steps.json`, its one writer and its one reader.

A watched rank (launch/rank/steps.py) keeps, in memory, how each of its steps
split into time waiting for input, in collectives and computing, and rewrites
this small file about once a second from a thread of its own: the last
`KEPT` steps, the totals since the call began, and its state now (in which
collective since when, the last progress). The notebook (watching/) reads it
again each second, as it is: a file replaced whole (`os.replace`), never half
written, a few KiB at most. On Ray the actor sends the file's bytes back with
each poll when they changed, and they are written here under the same name.

Times are wall-clock seconds (`time.time()`) of the rank's machine; how long a
rank has made no progress is measured against its own clock (`now` in the
file), so machines whose clocks differ are judged fairly.

This module starts nothing and knows no process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Steps each file keeps (the newest): enough for the detector's window and the ranks' skew.
KEPT = 64
#: The format's version, in the file.
VERSION = 1


@dataclass(frozen=True)
class Step:
    """One step of one rank: its index (from 0), and its seconds in all, waiting for input and in collectives."""

    index: int
    total: float
    input: float
    collective: float

    @property
    def compute(self) -> float:
        """The rest of the step: the rank's own work (and, under DDP, the all-reduce inside backward())."""
        return max(0.0, self.total - self.input - self.collective)


@dataclass(frozen=True)
class Collective:
    """A collective a rank is in (or, for an asynchronous one, last called): its name, its number, since when."""

    op: str
    number: int
    since: float


@dataclass(frozen=True)
class RankSteps:
    """What one rank's file says: its steps, totals, and state when it was written."""

    rank: int
    pid: int
    #: When the rank wrote the file, by its own clock.
    now: float
    #: Steps finished since the call began.
    count: int
    #: The rank's last progress (a batch, a step, a collective entered or left), by its own clock.
    progress: float
    #: Collectives called since the call began.
    calls: int
    #: Seconds since the call began: waiting for input, in collectives, in steps altogether.
    input_total: float = 0.0
    collective_total: float = 0.0
    step_total: float = 0.0
    #: The collective the rank is in now, if any.
    collective: Collective | None = None
    #: The last collective the rank called, when no progress was made since (an NCCL call returns before it is done).
    after: Collective | None = None
    recent: tuple[Step, ...] = field(default_factory=tuple)

    @property
    def waiting(self) -> Collective | None:
        """The collective the rank waits in, or last called with nothing done since."""
        return self.collective or self.after


def encode(state: RankSteps) -> bytes:
    """The file's bytes for `state`."""

    def coll(c: Collective | None) -> list[object] | None:
        return None if c is None else [c.op, c.number, round(c.since, 4)]

    return json.dumps(
        {
            "v": VERSION,
            "rank": state.rank,
            "pid": state.pid,
            "now": round(state.now, 4),
            "count": state.count,
            "progress": round(state.progress, 4),
            "calls": state.calls,
            "totals": [round(state.input_total, 4), round(state.collective_total, 4), round(state.step_total, 4)],
            "collective": coll(state.collective),
            "after": coll(state.after),
            "recent": [[s.index, round(s.total, 5), round(s.input, 5), round(s.collective, 5)] for s in state.recent],
        },
        separators=(",", ":"),
    ).encode()


def decode(data: bytes) -> RankSteps | None:
    """What `encode` wrote, or None for bytes that are not such a file (another version, a torn copy)."""
    try:
        raw = json.loads(data)
        if raw.get("v") != VERSION:
            return None

        def coll(c: list[Any] | None) -> Collective | None:
            return None if not c else Collective(str(c[0]), int(c[1]), float(c[2]))

        inputs, collectives, steps = (float(x) for x in raw["totals"])
        return RankSteps(
            rank=int(raw["rank"]),
            pid=int(raw["pid"]),
            now=float(raw["now"]),
            count=int(raw["count"]),
            progress=float(raw["progress"]),
            calls=int(raw["calls"]),
            input_total=inputs,
            collective_total=collectives,
            step_total=steps,
            collective=coll(raw.get("collective")),
            after=coll(raw.get("after")),
            recent=tuple(Step(int(i), float(t), float(n), float(c)) for i, t, n, c in raw["recent"]),
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


def write(path: Path, state: RankSteps) -> None:
    """Replace the rank's file with `state`, whole (0600)."""
    write_bytes(path, encode(state))


def write_bytes(path: Path, data: bytes) -> None:
    """Replace the file with `data`, whole (0600): a rank's own write, or a copy a Ray rank sent."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read(path: Path) -> RankSteps | None:
    """The rank's file as last written, or None when there is none yet (or it cannot be read)."""
    try:
        return decode(path.read_bytes())
    except OSError:
        return None


def read_bytes(path: Path) -> bytes | None:
    """The file's bytes as they are (for a Ray rank to send back), or None."""
    try:
        return path.read_bytes()
    except OSError:
        return None
