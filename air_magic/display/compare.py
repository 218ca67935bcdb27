"""One chart comparing the trials of a sweep: for each metric, a bar per trial with its last value.

HTML with inline SVG and a plain-text twin, like the record (record.py), so a saved notebook keeps it.
Knows nothing about sweeps or MLflow: it is given each trial's label and last values.
"""

from __future__ import annotations

import html

from .charts import MAX_CHARTS

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_BAR_W, _ROW_H = 220, 16


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _chart(key: str, values: list[tuple[str, float]]) -> str:
    top = max(abs(v) for _, v in values) or 1.0
    rows = []
    for n, (label, value) in enumerate(values):
        width = max(1.0, _BAR_W * abs(value) / top)
        color = _COLORS[n % len(_COLORS)]
        rows.append(
            f'<div style="display:flex;align-items:center;gap:6px;height:{_ROW_H}px">'
            f'<span style="width:14em;overflow:hidden;text-overflow:ellipsis;white-space:nowrap" '
            f'title="{html.escape(label, quote=True)}">{html.escape(label)}</span>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{_BAR_W}" height="{_ROW_H - 4}">'
            f'<rect x="0" y="0" width="{width:.1f}" height="{_ROW_H - 4}" fill="{color}"/></svg>'
            f"<span>{_fmt(value)}</span></div>"
        )
    return (
        f'<div class="air-magic-compare-chart" style="display:inline-block;vertical-align:top;margin:0 16px 8px 0;'
        f'font-size:11px"><div><b>{html.escape(key)}</b> <span style="color:#777">last value</span></div>'
        f"{''.join(rows)}</div>"
    )


def compare_bundle(title: str, trials: list[tuple[str, dict[str, float]]]) -> dict[str, str]:
    """{'text/html', 'text/plain'}: each metric any trial logged, its last value in each trial that logged it."""
    keys = list(dict.fromkeys(k for _, last in trials for k in last))
    charts = [_chart(k, [(label, last[k]) for label, last in trials if k in last]) for k in keys[:MAX_CHARTS]]
    body = "".join(charts) or '<div style="color:#777">no trial has logged a metric yet</div>'
    text = [title]
    for key in keys:
        text.append(f"  {key}: " + "; ".join(f"{label} {_fmt(last[key])}" for label, last in trials if key in last))
    return {
        "text/html": f'<div class="air-magic-compare"><div><b>{html.escape(title)}</b></div>{body}</div>',
        "text/plain": "\n".join(text),
    }
