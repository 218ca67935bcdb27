"""The profile of a call (`JobResult.profile`, profiling/) as HTML: the table of every rank's profiled steps, the
slowest rank and why, the skew, the top ops and where the traces are. The record (record.py) shows it; plain HTML
that JupyterLab keeps in untrusted notebooks; the panel's Profile button shows it too (`PanelProfiling`). Knows
nothing about widgets; the text is `Profile.table()`.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable
from pathlib import Path

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


#: Steps the panel's Profile button profiles.
PANEL_STEPS = 5


class PanelProfiling:
    """What the panel's Profile button started: `ask` (from the click's thread) profiles the next PANEL_STEPS steps
    of the running call on a thread of its own (profiling/live.py); `take` (from the runner's thread, which alone
    touches widgets) gives the view's HTML once, when there is something new to show."""

    def __init__(self) -> None:
        self.busy = False
        self.profiles: list[Profile] = []
        self._html: str | None = None

    def ask(self, run_dir: Path, world_size: int, watched: bool, running: Callable[[], bool]) -> None:
        """Profile on a thread of its own: the request (which may wait a moment for the ranks' first steps), then
        the ranks' traces."""
        from ..profiling.live import check

        if self.busy:
            return
        try:
            check(PANEL_STEPS, watched)
        except Exception as exc:  # noqa: BLE001 - said in the view; the call goes on
            self._html = f'<span style="color:#c62828">profile failed: {html.escape(str(exc))}</span>'
            return
        self.busy = True
        self._html = f"<i>profiling {PANEL_STEPS} steps of every rank…</i>"
        args = (run_dir, world_size, running)
        threading.Thread(target=self._profile, args=args, name="air_magic-profile", daemon=True).start()

    def _profile(self, run_dir: Path, world_size: int, running: Callable[[], bool]) -> None:
        from ..profiling.live import profile_running

        try:
            found = profile_running(run_dir, world_size, PANEL_STEPS, 600, running)
        except Exception as exc:  # noqa: BLE001 - said in the view; the call goes on
            self._html = f'<span style="color:#c62828">profile failed: {html.escape(str(exc))}</span>'
        else:
            self.profiles.append(found)
            self._html = profile_html(found)
        finally:
            self.busy = False

    def take(self) -> str | None:
        shown, self._html = self._html, None
        return shown
