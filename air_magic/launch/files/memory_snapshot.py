"""A rank's CUDA memory: torch's snapshot (`rank-N.memory.pickle`) read for its largest live allocation sites, and the
rank's peak per call (`rank-N.memory.json`), with their one writer and reader.

The snapshot is `torch.cuda.memory._snapshot()`'s dictionary as torch pickles
it (`_dump_snapshot`), which PyTorch's memory viewer (https://pytorch.org/memory_viz)
opens: `segments`, each with its `blocks` (`size`, `requested_size`, `state`
"active_allocated" for memory a tensor holds, and `frames`, innermost first,
each `filename`, `line`, `name`; older snapshots keep them in `history`). A
site is the innermost frame of an allocation outside torch's own code (the
line of the user's code that asked for it). The rank writes the snapshot when
it runs out of memory (launch/rank/memory.py); this module only reads it.
Starts nothing, knows no process, and needs no torch.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .step_times import write_bytes

#: Sites an out-of-memory error lists.
TOP = 10
#: Path parts of frames inside torch and Python's own code, passed over for the first frame outside them.
_LIBRARY = ("/torch/", "/site-packages/", "/dist-packages/", "/lib/python3")


@dataclass(frozen=True)
class Site:
    """A line of code holding live allocations: its file, line, function and bytes in all (and how many blocks)."""

    filename: str
    line: int
    function: str
    size: int
    blocks: int

    def text(self) -> str:
        return (
            f"{human_bytes(self.size)} in {self.blocks} block(s) at {self.function} ({self.filename}, line {self.line})"
        )


def human_bytes(n: float) -> str:
    """Bytes as GiB, MiB or KiB with one decimal (or bytes)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _frames(block: dict[str, Any]) -> list[dict[str, Any]]:
    frames = block.get("frames")
    if frames is None:
        history = block.get("history") or [{}]
        frames = history[0].get("frames", [])
    return list(frames or [])


def _site(frames: list[dict[str, Any]]) -> tuple[str, int, str]:
    """The innermost frame outside torch and the libraries (else the innermost frame with a file)."""
    known = [f for f in frames if f.get("filename") and not str(f["filename"]).startswith("??")]
    for frame in known:
        if not any(part in str(frame["filename"]) for part in _LIBRARY):
            return str(frame["filename"]), int(frame.get("line", 0)), str(frame.get("name", "?"))
    if known:
        f = known[0]
        return str(f["filename"]), int(f.get("line", 0)), str(f.get("name", "?"))
    return "<no stack recorded>", 0, "?"


def top_sites(snapshot: dict[str, Any], limit: int = TOP, device: int | None = None) -> list[Site]:
    """The `limit` sites holding the most live memory (blocks "active_allocated"), largest first."""
    sizes: dict[tuple[str, int, str], int] = defaultdict(int)
    counts: dict[tuple[str, int, str], int] = defaultdict(int)
    for segment in snapshot.get("segments", []):
        if device is not None and segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            key = _site(_frames(block))
            sizes[key] += int(block.get("requested_size") or block.get("size", 0))
            counts[key] += 1
    ranked = sorted(sizes.items(), key=lambda item: -item[1])[:limit]
    return [Site(f, line, name, size, counts[(f, line, name)]) for (f, line, name), size in ranked]


def write_peak(path: Path, device: int, peak_allocated: int, peak_reserved: int) -> None:
    """The rank's peak CUDA memory of the call, from torch's own counters."""
    data = {"v": 1, "device": device, "peak_allocated": peak_allocated, "peak_reserved": peak_reserved}
    write_bytes(path, json.dumps(data).encode())


def read_peak(path: Path) -> dict[str, int] | None:
    """What `write_peak` wrote ({device, peak_allocated, peak_reserved}), or None."""
    try:
        raw = json.loads(path.read_bytes())
        return {k: int(raw[k]) for k in ("device", "peak_allocated", "peak_reserved")}
    except (OSError, ValueError, TypeError, KeyError):
        return None
