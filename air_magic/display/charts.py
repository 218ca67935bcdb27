"""Live metric charts: what the ranks log with `mlflow.log_metric(s)`, read from their run-directory files.

Each rank's MLflow hook appends one JSON line per value to its chart file in
the run directory (the format: tracking/tee.py); `MetricsTail` follows those files
from the display's poll, so the charts never ask the tracking server anything.
`charts_html` draws one small inline-SVG line chart per metric, one line per
rank, bounded in points. Knows nothing about widgets; the panel and the static
record both use it.
"""

from __future__ import annotations

import html
from pathlib import Path

from ..launch.files.rundir import RunDir
from ..tracking.tee import decode

#: Points kept per metric and rank; past that every other point is dropped (the newest is always kept).
MAX_POINTS = 400
#: Charts drawn at most; further metrics are named in a note.
MAX_CHARTS = 12
#: Bytes read from one rank's metrics file per poll.
READ_CHUNK = 1 << 20
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_W, _H, _PAD = 240, 96, 4


def metrics_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` of a run appends its logged metrics."""
    return RunDir(run_dir).chart_metrics(rank)


class _Series:
    __slots__ = ("count", "points", "skipped", "stride")

    def __init__(self) -> None:
        self.points: list[tuple[float, float]] = []
        self.stride = 1  # keep one point in `stride` once thinned
        self.skipped = 0
        self.count = 0

    def add(self, x: float, y: float) -> None:
        self.count += 1
        if self.skipped + 1 < self.stride and self.points:
            self.skipped += 1
            self.points[-1] = (x, y)  # the newest value always shows
            return
        self.skipped = 0
        self.points.append((x, y))
        if len(self.points) > MAX_POINTS:
            self.points = self.points[::2] + ([self.points[-1]] if len(self.points) % 2 == 0 else [])
            self.stride *= 2


class MetricsTail:
    """Follows every rank's metrics file; `series[key][rank]` holds (step, value) points, bounded."""

    def __init__(self, run_dir: Path, world_size: int) -> None:
        self.paths = [metrics_path(run_dir, r) for r in range(world_size)]
        self.offsets = [0] * world_size
        self.partial = [b""] * world_size
        self.series: dict[str, dict[int, _Series]] = {}

    def poll(self) -> bool:
        """Read what the ranks appended since the last call; True if any point was added."""
        added = False
        for rank, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[rank])
                    data = f.read(READ_CHUNK)
            except OSError:
                continue
            if not data:
                continue
            self.offsets[rank] += len(data)
            lines = (self.partial[rank] + data).split(b"\n")
            self.partial[rank] = lines.pop()
            for line in lines:
                added |= self._take(rank, line)
        return added

    def _take(self, rank: int, line: bytes) -> bool:
        point = decode(line)
        if point is None:
            return False
        series = self.series.setdefault(point.key, {}).setdefault(rank, _Series())
        series.add(float(series.count) if point.step is None else point.step, point.value)
        return True


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _chart(key: str, per_rank: dict[int, _Series]) -> str:
    points = [p for s in per_rank.values() for p in s.points]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    sx = (_W - 2 * _PAD) / (x1 - x0)
    sy = (_H - 2 * _PAD) / (y1 - y0)
    lines = []
    for rank in sorted(per_rank):
        color = _COLORS[rank % len(_COLORS)]
        coords = " ".join(
            f"{_PAD + (x - x0) * sx:.1f},{_H - _PAD - (y - y0) * sy:.1f}" for x, y in per_rank[rank].points
        )
        if len(per_rank[rank].points) == 1:
            x, y = coords.split(",")
            lines.append(f'<circle cx="{x}" cy="{y}" r="2" fill="{color}"/>')
        else:
            lines.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
    legend = " ".join(
        f'<span style="color:{_COLORS[r % len(_COLORS)]};white-space:nowrap">'
        f"rank {r}: {_fmt(per_rank[r].points[-1][1])}</span>"
        for r in sorted(per_rank)
    )
    name = html.escape(key)
    return (
        f'<div class="air-magic-chart" title="{name}" style="display:inline-block;vertical-align:top;'
        f'margin:0 12px 6px 0;font-size:11px;line-height:1.3;width:{_W}px">'
        f'<div><b>{name}</b> <span style="color:#777">step {_fmt(x0)}–{_fmt(max(xs))}, '
        f"{_fmt(min(ys))} … {_fmt(max(ys))}</span></div>"
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
        f'style="background:#fafafa;border:1px solid #ddd">{"".join(lines)}</svg>'
        f"<div>{legend}</div></div>"
    )


def charts_html(tail: MetricsTail | None) -> str:
    """One small line chart per metric (one line per rank), as HTML with inline SVG; '' if nothing was logged."""
    if tail is None or not tail.series:
        return ""
    keys = list(tail.series)
    body = "".join(_chart(k, tail.series[k]) for k in keys[:MAX_CHARTS])
    if len(keys) > MAX_CHARTS:
        body += f'<div style="color:#777">… {len(keys) - MAX_CHARTS} more metric(s) in the MLflow run</div>'
    return f'<div class="air-magic-charts">{body}</div>'


def charts_text(tail: MetricsTail | None) -> str:
    """The last value of each metric per rank, as plain lines ('' if nothing was logged)."""
    if tail is None or not tail.series:
        return ""
    lines = []
    for key, per_rank in tail.series.items():
        last = ", ".join(f"rank {r}: {_fmt(per_rank[r].points[-1][1])}" for r in sorted(per_rank))
        lines.append(f"  {key} ({max(s.count for s in per_rank.values())} values) — last {last}")
    return "metrics:\n" + "\n".join(lines)
