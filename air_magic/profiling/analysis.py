"""The ranks' profiled steps, read from their traces: the per-rank split, the slowest rank and why, the top ops, skew.

Each rank's trace (torch.profiler's Chrome JSON) covers its profiled steps,
marked `air_magic step K` on the thread that ran them, with its DataLoader
waits (`air_magic: input`) and blocking collectives (`air_magic: all_reduce
#12`) marked too (launch/rank/profiler.py). Per step, on average:

- CPU ranks, from the steps' thread: `input` is the time in DataLoader waits;
  `collective` the time in blocking collectives, plus the time a gloo (or
  NCCL) operation ran on a thread of its own while the steps' thread ran no
  operator but a `c10d::` one (DDP's gradient all-reduce, waited for inside
  `backward()`; or in its own launch, `c10d::allreduce_`, when that returns
  only once the reduction is done, as on a CPU with more threads than cores);
  `compute` the rest of the step; `idle` 0.
- GPU ranks, from the GPU's kernels: `compute` the time some kernel other than
  NCCL's ran, `collective` the time NCCL kernels ran alone, `idle` the time no
  kernel ran; `input` as on CPU (a CPU wait, which the GPU sees as idle).

The slowest rank is the one whose own time (compute + input) is longest; its
cause the one of the two by which it exceeds the other ranks' median most.
The skew is read from the `c10d::` operators (every collective, DDP's
included), matched across ranks by name and order in the same steps (no skew
is said for windows of different steps): the rank furthest behind the first
over all of them, at how many it was last, its time behind the first rank per
step (summed over the step's collectives) and at most at one. Times are absolute (the trace's base time
plus its offsets); ranks on other hosts are aligned on the ends of their
blocking collectives, which end together on every rank.

Not for writing the merged trace (merge.py) or showing the result (display/).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..launch.files import profile_windows
from ..launch.files.rundir import RunDir
from .profile import Op, Skew

Span = tuple[float, float]
#: Operators listed per rank.
TOP = 10
STEP_MARK = "air_magic step "
INPUT_MARK = "air_magic: input"
COLLECTIVE_MARK = "air_magic: "
#: Operations of the communication libraries, run on threads of their own (CPU ranks).
COMM_PREFIXES = ("gloo:", "nccl:")
#: The operators that hand a collective to them, on the steps' thread: communication, not compute.
C10D = "c10d::"
KERNELS = ("kernel", "gpu_memcpy", "gpu_memset")


def union(spans: list[Span]) -> list[Span]:
    """The spans merged: sorted, none overlapping."""
    out: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(spans: list[Span]) -> float:
    return sum(end - start for start, end in union(spans))


def subtract(spans: list[Span], minus: list[Span]) -> list[Span]:
    """The parts of `spans` outside every span of `minus`."""
    out: list[Span] = []
    cut = union(minus)
    for start, end in union(spans):
        at = start
        for c_start, c_end in cut:
            if c_end <= at or c_start >= end:
                continue
            if c_start > at:
                out.append((at, c_start))
            at = max(at, c_end)
        if at < end:
            out.append((at, end))
    return out


def clip(spans: list[Span], window: Span) -> list[Span]:
    return [(max(s, window[0]), min(e, window[1])) for s, e in spans if e > window[0] and s < window[1]]


@dataclass
class RankTrace:
    """One rank's trace: its complete events, with absolute times in µs (`at`, `end`), and what it covers."""

    rank: int
    path: Path
    window: profile_windows.Window
    events: list[dict[str, Any]]
    host: str
    offset: float = 0.0
    #: The trace's base time, in ns since the epoch (its `ts` count µs from it).
    base_ns: int = 0

    def spans(self, keep: Any) -> list[Span]:
        return [(e["at"], e["end"]) for e in self.events if keep(e)]

    def on_main(self, e: dict[str, Any]) -> bool:
        return str(e.get("tid")) == str(self.window.thread)

    def steps(self) -> list[Span]:
        """The counted steps: those the window says it profiled (a last one the call's end cut short is left out)."""
        counted = {f"{STEP_MARK}{i}" for i in range(self.window.first, self.window.first + self.window.steps)}
        return self.spans(lambda e: self.on_main(e) and e.get("name") in counted)


def read_trace(rank: int, path: Path, window: profile_windows.Window) -> RankTrace:
    """A rank's trace file as a RankTrace (raises OSError or ValueError for a file that is not one)."""
    raw = json.loads(path.read_bytes())
    base_ns = int(raw.get("baseTimeNanoseconds", 0))
    base = base_ns / 1000
    events = []
    for e in raw.get("traceEvents", []):
        if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)):
            at = base + float(e["ts"])
            events.append({**e, "at": at, "end": at + float(e.get("dur", 0.0))})
    return RankTrace(rank, path, window, events, str(raw.get("host_name", window.host)), base_ns=base_ns)


def load(run_dir: RunDir, world_size: int, number: int = 0) -> tuple[list[RankTrace], dict[int, str]]:
    """Every rank's trace that can be read (of `profile=N`, or of the `number`th `handle.profile()`), and for each
    rank without one, why."""
    traces: list[RankTrace] = []
    missing: dict[int, str] = {}
    for rank in range(world_size):
        window = profile_windows.read(run_dir.profile_window(rank, number))
        if window is None:
            missing[rank] = "it wrote no profile: it ended before its second step, or was not watched"
            continue
        if not window.trace:
            missing[rank] = window.error or "it wrote no trace"
            continue
        try:
            trace = read_trace(rank, run_dir.path / window.trace, window)
        except (OSError, ValueError) as exc:
            missing[rank] = f"its trace could not be read: {exc}"
            continue
        if not trace.steps():
            missing[rank] = "its trace holds no profiled step"
            continue
        traces.append(trace)
    return traces, missing


def breakdown(trace: RankTrace) -> dict[str, float]:
    """Seconds per step of one rank: step, compute, collective, input, idle (see the module)."""
    steps = trace.steps()
    window = (min(s for s, _ in steps), max(e for _, e in steps))
    total = window[1] - window[0]
    inputs = clip(trace.spans(lambda e: trace.on_main(e) and e.get("name") == INPUT_MARK), window)
    kernels = [e for e in trace.events if e.get("cat") in KERNELS]
    if kernels:
        comm = [(e["at"], e["end"]) for e in kernels if "nccl" in str(e.get("name", "")).lower()]
        work = [(e["at"], e["end"]) for e in kernels if "nccl" not in str(e.get("name", "")).lower()]
        compute = length(clip(work, window))
        collective = length(subtract(clip(comm, window), work))
        idle = total - length(clip(comm + work, window))
    else:
        marks = [
            (e["at"], e["end"])
            for e in trace.events
            if trace.on_main(e) and str(e.get("name", "")).startswith(COLLECTIVE_MARK) and e.get("name") != INPUT_MARK
        ]
        others = trace.spans(lambda e: not trace.on_main(e) and str(e.get("name", "")).startswith(COMM_PREFIXES))
        ops = trace.spans(lambda e: trace.on_main(e) and e.get("cat") == "cpu_op")
        launches = trace.spans(lambda e: trace.on_main(e) and str(e.get("name", "")).startswith(C10D))
        busy = subtract(ops, launches)  # the operators that enclose a launch (autograd's) are not busy during it
        waits = subtract(clip(marks, window), inputs)
        exposed = subtract(subtract(clip(others, window), busy), inputs)
        collective = length(waits + exposed)
        compute = max(0.0, total - length(inputs) - collective)
        idle = 0.0
    per_step = 1e6 * len(steps)  # the trace's µs -> seconds per step
    return {
        "rank": trace.rank,
        "step": total / per_step,
        "compute": compute / per_step,
        "collective": collective / per_step,
        "input": length(inputs) / per_step,
        "idle": max(0.0, idle) / per_step,
    }


def top_ops(trace: RankTrace, limit: int = TOP) -> list[Op]:
    """The operators with the most time of their own (children's left out) per step, most first."""
    steps = trace.steps()
    window = (min(s for s, _ in steps), max(e for _, e in steps))
    own: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in trace.events:
        name = str(e.get("name", ""))
        listed = e.get("cat") in ("cpu_op", "user_annotation", *KERNELS) and not name.startswith("air_magic")
        if listed and e["end"] > window[0] and e["at"] < window[1]:
            by_thread[(e.get("pid"), e.get("tid"), e.get("cat") in KERNELS)].append(e)
    for events in by_thread.values():
        stack: list[list[Any]] = []  # [event, time of its children]
        for e in sorted(events, key=lambda e: (e["at"], -e["end"])):
            while stack and stack[-1][0]["end"] <= e["at"]:
                done, children = stack.pop()
                own[done["name"]] += done["end"] - done["at"] - children
            if stack:
                stack[-1][1] += e["end"] - e["at"]
            stack.append([e, 0.0])
            calls[e["name"]] += 1
        for done, children in stack:
            own[done["name"]] += done["end"] - done["at"] - children
    n = len(steps)
    ranked = sorted(own.items(), key=lambda item: -item[1])[:limit]
    return [Op(name, calls[name], max(0.0, seconds) / 1e6 / n) for name, seconds in ranked]


def align(traces: list[RankTrace]) -> None:
    """Set each trace's clock offset (µs) to the first's: 0 on one host; else the median gap between the ends of
    their blocking collectives, which end together on every rank."""
    if len({t.host for t in traces}) <= 1:
        return
    first = traces[0]
    ends = _collective_ends(first)
    for trace in traces[1:]:
        gaps = [ends[key] - end for key, end in _collective_ends(trace).items() if key in ends]
        trace.offset = statistics.median(gaps) if gaps else 0.0


def _collective_ends(trace: RankTrace) -> dict[str, float]:
    return {
        str(e["name"]): e["end"]
        for e in trace.events
        if trace.on_main(e) and str(e.get("name", "")).startswith(COLLECTIVE_MARK) and e["name"] != INPUT_MARK
    }


def skew(traces: list[RankTrace]) -> Skew | None:
    """Who starts the collectives last (see the module), or None with fewer than 2 ranks or no collective."""
    if len(traces) < 2 or len({t.window.first for t in traces}) > 1:
        return None  # collectives are matched by their order in the same steps of every rank
    arrivals: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for trace in traces:
        seen: Counter[str] = Counter()
        window = (min(s for s, _ in trace.steps()), max(e for _, e in trace.steps()))
        ops = [e for e in trace.events if str(e.get("name", "")).startswith(C10D) and e.get("cat") == "cpu_op"]
        for e in sorted(ops, key=lambda e: e["at"]):
            if window[0] <= e["at"] <= window[1]:
                arrivals[(e["name"], seen[e["name"]])][trace.rank] = e["at"] + trace.offset
                seen[e["name"]] += 1
    lasts: dict[int, list[float]] = defaultdict(list)
    late: dict[int, float] = defaultdict(float)  # each rank's time after the first, over every collective
    matched = [a for a in arrivals.values() if len(a) == len(traces)]
    for at in matched:
        first = min(at.values())
        for r, t in at.items():
            late[r] += t - first
        last = max(at, key=lambda r: at[r])
        lasts[last].append((at[last] - first) / 1e6)
    if not lasts:
        return None
    rank = max(lasts, key=lambda r: late[r])  # most behind in all: not the one last most often by a hair
    steps = min(len(t.steps()) for t in traces)
    return Skew(rank, late[rank] / 1e6 / steps, len(lasts[rank]), len(matched), max(lasts[rank]))


def slowest(rows: list[dict[str, float]]) -> tuple[tuple[int, str] | None, float]:
    """(rank, cause) of the rank with the longest own time (compute + input) per step, and how much longer it is
    than the others' median; the cause is what it exceeds their median by most."""
    if not rows:
        return None, 0.0
    row = max(rows, key=lambda r: r["compute"] + r["input"])
    others = [r for r in rows if r is not row]
    if not others:
        return (int(row["rank"]), max(("compute", "input"), key=lambda c: row[c])), 0.0

    def median(key: str) -> float:
        return statistics.median(r[key] for r in others)

    cause = max(("compute", "input"), key=lambda c: row[c] - median(c))
    lag = row["compute"] + row["input"] - statistics.median(r["compute"] + r["input"] for r in others)
    return (int(row["rank"]), cause), lag
