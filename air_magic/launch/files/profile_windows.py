"""Which steps a rank profiled: `rank-N.profile.json`, its one writer (the rank) and its one reader (the notebook).

A rank asked to profile N of its watch's steps (launch/rank/profiler.py) runs
torch.profiler over those steps only and writes its Chrome trace beside this
small file, which says what the trace covers: the first step profiled, how
many, on which thread the steps ran (the trace's thread id of the rank's main
thread), on which host (ranks on other machines have other clocks), and the
watch's own split of each profiled step (total, input, collective), or why no
trace was written. The notebook's analysis (profiling/) reads both.

A call already running is asked through `profile.request` (`handle.profile(steps)`): the request's number, steps
and the step every rank starts at, which each rank's watch reads about once a second; its files are numbered
after it.

This module starts nothing and knows no process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .step_times import write_bytes

#: The format's version, in the file.
VERSION = 1


@dataclass(frozen=True)
class Window:
    """One rank's profiled steps: what its trace covers."""

    rank: int
    #: Steps asked for, and steps profiled (fewer when the call ended first).
    asked: int
    steps: int
    #: The index (from 0) of the first step profiled.
    first: int
    #: The native id of the thread that ran the steps (the trace's `tid` of its events).
    thread: int
    host: str
    #: The trace's file name in the run directory ("" when none was written).
    trace: str = ""
    #: Why no trace was written ("" when one was).
    error: str = ""
    #: The watch's split of each profiled step: (total, input, collective) seconds.
    step_times: tuple[tuple[float, float, float], ...] = field(default_factory=tuple)


def encode(window: Window) -> bytes:
    """The file's bytes for `window`."""
    raw: dict[str, Any] = {"v": VERSION, **window.__dict__}
    raw["step_times"] = [[round(x, 6) for x in s] for s in window.step_times]
    return json.dumps(raw, separators=(",", ":")).encode()


def decode(data: bytes) -> Window | None:
    """What `encode` wrote, or None for bytes that are not such a file."""
    try:
        raw = json.loads(data)
        if raw.get("v") != VERSION:
            return None
        return Window(
            rank=int(raw["rank"]),
            asked=int(raw["asked"]),
            steps=int(raw["steps"]),
            first=int(raw["first"]),
            thread=int(raw["thread"]),
            host=str(raw["host"]),
            trace=str(raw.get("trace", "")),
            error=str(raw.get("error", "")),
            step_times=tuple((float(t), float(i), float(c)) for t, i, c in raw.get("step_times", ())),
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def write_request(path: Path, number: int, steps: int, at: int) -> None:
    """Ask a running call's ranks to profile `steps` steps from their step `at` (its warm-up; every rank the same
    steps), as its `number`th request (from 1)."""
    write_bytes(path, json.dumps({"v": VERSION, "number": number, "steps": steps, "at": at}).encode())


def read_request(path: Path) -> tuple[int, int, int] | None:
    """(number, steps, at) of the last request, or None when there is none."""
    try:
        raw = json.loads(path.read_bytes())
        return int(raw["number"]), int(raw["steps"]), int(raw["at"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def write(path: Path, window: Window) -> None:
    """Replace the rank's file with `window`, whole (0600)."""
    write_bytes(path, encode(window))


def read(path: Path) -> Window | None:
    """The rank's file, or None when it wrote none (it was not profiled, or did not reach a profiled step)."""
    try:
        return decode(path.read_bytes())
    except OSError:
        return None
