"""The profile of a call (`JobResult.profile`, profiling/) as HTML: the table of every rank's profiled steps, the
slowest rank and why, the skew, the top ops and where the traces are. The record (record.py) shows it; plain HTML
that JupyterLab keeps in untrusted notebooks. Knows nothing about widgets; the text is `Profile.table()`.
"""

from __future__ import annotations

import html

from ..profiling.profile import Profile

_CELL = "padding:1px 8px;text-align:right;border-bottom:1px solid #eee"


def profile_html(profile: Profile) -> str:
    """The profile's table and notes (see the module)."""
    rows = profile.rows()
    slow = profile.slowest[0] if profile.slowest is not None else None
    head = "".join(f'<th style="{_CELL}">{html.escape(c)}</th>' for c in rows[0])
    marked = ' style="background:#fff3e0"'
    body = "".join(
        f"<tr{marked if str(slow) == row[0] else ''}>"
        + "".join(f'<td style="{_CELL}">{html.escape(c)}</td>' for c in row)
        + "</tr>"
        for row in rows[1:]
    )
    notes = [html.escape(profile.summary())]
    for rank, ops in sorted(profile.top_ops.items()):
        listed = ", ".join(f"{html.escape(op.name)} {op.seconds * 1000:.1f} ms" for op in ops)
        notes.append(f"<details><summary>rank {rank}: top ops (own time per step)</summary>{listed}</details>")
    notes += [f"rank {rank}: no profile ({html.escape(why)})" for rank, why in sorted(profile.missing.items())]
    if profile.trace is not None:
        notes.append(f"merged trace (opens in https://ui.perfetto.dev): <code>{html.escape(str(profile.trace))}</code>")
    return (
        '<div class="air-magic-record-profile" style="font-size:12px;margin:4px 0">'
        f'<table style="border-collapse:collapse;font-variant-numeric:tabular-nums"><tr>{head}</tr>{body}</table>'
        + "".join(f"<div>{note}</div>" for note in notes)
        + "</div>"
    )
