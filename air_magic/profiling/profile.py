"""What profiling N steps of every rank found: the public `Profile` (`JobResult.profile`) and its text table.

Plain data, built by the analysis (analysis.py) from the ranks' traces; the
display, the record and MLflow show it. Knows no file format, process or widget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The columns of `Profile.ranks`, in the order the table shows them (seconds per step, `rank` aside).
COLUMNS = ("step", "compute", "collective", "input", "idle")


@dataclass(frozen=True)
class Op:
    """One operator of one rank's profiled steps: its name, how many times it ran, its own time (children's left
    out) per step, in seconds."""

    name: str
    calls: int
    seconds: float


@dataclass(frozen=True)
class Skew:
    """Which rank arrives last at the collectives of the profiled steps (the one furthest behind the first rank over
    all of them), at how many of how many it was last; by how much: its seconds after the first rank per step, over
    every collective of the step, and at most at one."""

    rank: int
    seconds: float
    last: int
    collectives: int
    worst: float = 0.0

    def text(self) -> str:
        return (
            f"rank {self.rank} arrives last at {self.last} of {self.collectives} collectives, "
            f"{self.seconds * 1000:.1f} ms per step after the first rank (at most {self.worst * 1000:.1f} ms at one)"
        )


@dataclass(frozen=True)
class Profile:
    """N profiled steps of every rank (docs/profiling.md).

    `ranks`: one dict per rank, `rank` and seconds per step: `step`, `compute`, `collective` (in NCCL or gloo
    kernels and waits), `input` (DataLoader) and `idle` (GPU time with no kernel; 0 on CPU ranks).
    `slowest`: (rank, cause), cause `"compute"` or `"input"`; `lag`: its own time (compute + input) per step beyond
    the others' median. `trace`: the merged Chrome/Perfetto trace (a process per rank, clocks aligned);
    `traces`: each rank's own trace. `top_ops`: each rank's 10 operators with the most time of their own.
    `skew`: who arrives last at the collectives (None without any). `steps`: steps profiled per rank;
    `first_step`: the first of them (the watch's step index, from 0).
    """

    ranks: list[dict[str, float]]
    slowest: tuple[int, str] | None
    trace: Path | None
    traces: list[Path]
    lag: float = 0.0
    top_ops: dict[int, list[Op]] = field(default_factory=dict)
    skew: Skew | None = None
    steps: int = 0
    first_step: int = 0
    #: Ranks that left no trace, and why.
    missing: dict[int, str] = field(default_factory=dict)
    #: Bytes of each rank's trace and of the merged one.
    sizes: dict[str, int] = field(default_factory=dict)

    def rows(self) -> list[list[str]]:
        """The table's cells: a header, then one row per rank (milliseconds per step)."""
        rows = [["rank", *(f"{c} ms" for c in COLUMNS)]]
        for row in self.ranks:
            rows.append([str(int(row["rank"])), *(f"{row[c] * 1000:.1f}" for c in COLUMNS)])
        return rows

    def summary(self) -> str:
        """One line: the slowest rank and its cause, how far behind, and the skew."""
        words = f"profiled {self.steps} step(s) from step {self.first_step}"
        if self.slowest is not None:
            rank, cause = self.slowest
            words += f"; slowest: rank {rank} ({cause}, {self.lag * 1000:.1f} ms per step over the others' median)"
        if self.skew is not None:
            words += f"; {self.skew.text()}"
        return words

    def table(self) -> str:
        """The table as plain text, with the summary, the top ops and where the traces are."""
        rows = self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [self.summary()]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
        for rank, ops in sorted(self.top_ops.items()):
            listed = ", ".join(f"{op.name} {op.seconds * 1000:.1f} ms" for op in ops[:5])
            lines.append(f"rank {rank} top ops (own time per step): {listed}")
        for rank, why in sorted(self.missing.items()):
            lines.append(f"rank {rank}: no profile ({why})")
        if self.trace is not None:
            size = self.sizes.get("merged")
            lines.append(f"merged trace (open in https://ui.perfetto.dev): {self.trace}" + _size(size))
        for path in self.traces:
            lines.append(f"trace: {path}{_size(self.sizes.get(path.name))}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def record(self, number: int = 0) -> dict[str, Any]:
        """What the call's record (call.json) and `air-magic get` keep of it: plain JSON, paths as strings."""
        return {
            "number": number,
            "summary": self.summary(),
            "steps": self.steps,
            "first_step": self.first_step,
            "ranks": self.ranks,
            "slowest": list(self.slowest) if self.slowest is not None else None,
            "lag": self.lag,
            "skew": None if self.skew is None else self.skew.text(),
            "top_ops": {str(r): [[op.name, op.calls, op.seconds] for op in ops] for r, ops in self.top_ops.items()},
            "missing": {str(r): why for r, why in self.missing.items()},
            "trace": None if self.trace is None else str(self.trace),
            "traces": [str(p) for p in self.traces],
            "sizes": self.sizes,
        }


def _size(size: int | None) -> str:
    return "" if size is None else f" ({size / 2**20:.1f} MiB)"
