"""The live panel shown in Jupyter: a tab per rank, status, elapsed time, MLflow link, Cancel.

The only module of air_magic that imports ipywidgets. It is a runner
listener: every hook runs on the thread that made the call, so widgets are
only changed from that thread. Output is kept in a bounded tail per rank
(display/tail.py) and sent to the browser at most every REFRESH seconds, so
a flooding rank cannot drown the kernel or the browser; the full log stays
in the run directory. The Cancel click is delivered on a kernel subshell
thread (display/cancel_route.py) and only sets the call's cancel flag.
"""

from __future__ import annotations

import html
import time

import ipywidgets as w
from IPython.display import display

from ..events import Listener, RunContext
from ..job import JobResult, JobStatus, RankState
from .cancel_route import route_to_background
from .tail import TailBuffer

#: Seconds between two refreshes of a rank's tab (the browser sees at most this rate).
REFRESH = 0.1
#: Seconds between two updates of the clock.
CLOCK = 0.5

_LOG_STYLE = (
    "max-height:22em;overflow-y:auto;display:flex;flex-direction:column-reverse;"
    "font-family:var(--jp-code-font-family,monospace);font-size:12px;line-height:1.35;"
    "padding:4px 6px;background:var(--jp-layout-color1,#fff)"
)
_ENDED = {JobStatus.FINISHED: "finished", JobStatus.FAILED: "failed", JobStatus.KILLED: "stopped"}


def _title(rank: int, state: RankState) -> str:
    return f"rank {rank}: {state.value}"


class Panel(Listener):
    """One call's panel; build it with `Panel()` and hand it to the runner as a listener."""

    def __init__(self, refresh: float = REFRESH) -> None:
        self.refresh = refresh

    # -- runner hooks ------------------------------------------------------
    def on_start(self, ctx: RunContext) -> None:
        self.ctx = ctx
        spec = ctx.spec
        n = spec.world_size
        self.tails = [TailBuffer() for _ in range(n)]
        self.dirty: set[int] = set()
        self.last_flush = 0.0
        self.last_clock = 0.0
        self.phase = "starting"
        self.logs = [w.HTML(value=self._log_html(r), layout=w.Layout(width="100%")) for r in range(n)]
        self.tabs = w.Tab(children=self.logs, titles=tuple(_title(r, RankState.PENDING) for r in range(n)))
        self.status = w.HTML()
        self.link = w.HTML()
        self.cancel_button = w.Button(
            description="Cancel", icon="stop", button_style="danger", tooltip="Stop every rank of this call",
            layout=w.Layout(width="auto"),
        )
        self.cancel_button.on_click(self._clicked)
        self.cancel_hint = w.HTML()
        header = w.HBox(
            [self.status, self.link, self.cancel_button, self.cancel_hint],
            layout=w.Layout(align_items="center", justify_content="space-between"),
        )
        self.box = w.VBox([header, self.tabs])
        self.box.add_class("air-magic-panel")
        self._show_status()
        self._show_link()
        display(self.box)
        if not route_to_background(self.cancel_button):
            self.cancel_button.layout.display = "none"
            self.cancel_hint.value = "<i>Stop with the kernel's interrupt button (■).</i>"

    def on_output(self, rank: int, text: str) -> None:
        self.tails[rank].feed(text)
        self.dirty.add(rank)

    def on_rank_state(self, rank: int, state: RankState) -> None:
        if self.phase == "starting" and state == RankState.RUNNING:
            self.phase = "running"
        self.tabs.set_title(rank, _title(rank, state))

    def poll(self) -> None:
        now = time.monotonic()
        if self.dirty and now - self.last_flush >= self.refresh:
            self._flush()
            self.last_flush = now
        if self.ctx.cancelled and not self.cancel_button.disabled:
            self.phase = "cancelling"
            self.cancel_button.disabled = True
            self.cancel_button.description = "Cancelling…"
            self._show_status()
        elif now - self.last_clock >= CLOCK:
            self._show_status()
        self._show_link()

    def on_end(self, result: JobResult) -> None:
        self.dirty.update(range(len(self.tails)))
        self._flush()
        for rank in result.ranks:
            self.tabs.set_title(rank.rank, _title(rank.rank, rank.state))
        if self.ctx.cancelled and result.status == JobStatus.KILLED:
            self.phase = "cancelled"
        else:
            self.phase = _ENDED[result.status]
        self.cancel_button.disabled = True
        if self.phase == "cancelled":
            self.cancel_button.description = "Cancelled"
        else:
            self.cancel_button.layout.visibility = "hidden"  # keeps the header's layout steady
        self._show_status(result.elapsed)
        self._show_link()

    # -- drawing -----------------------------------------------------------
    def _clicked(self, _button: w.Button) -> None:
        # Runs on the subshell thread while the cell is busy: only set the flag;
        # the runner stops the ranks and the next poll() redraws the button.
        self.ctx.cancel()

    def _log_html(self, rank: int) -> str:
        tail = self.tails[rank]
        # the note stays above the scrolling area, which is pinned to its newest line
        return (
            f'<div class="air-magic-log" data-rank="{rank}">{tail.note_html(str(self.ctx.log_paths[rank]))}'
            f'<div style="{_LOG_STYLE}"><div>{tail.body_html()}</div></div></div>'
        )

    def _flush(self) -> None:
        for rank in sorted(self.dirty):
            self.logs[rank].value = self._log_html(rank)
        self.dirty.clear()

    def _show_status(self, elapsed: float | None = None) -> None:
        spec = self.ctx.spec
        seconds = self.ctx.elapsed if elapsed is None else elapsed
        self.last_clock = time.monotonic()
        self.status.value = (
            f"<b>{html.escape(spec.name)}</b> · {spec.world_size} rank(s) · {html.escape(spec.accelerator_type)}"
            f' · <span class="air-magic-phase">{self.phase}</span> · {seconds:.0f} s'
        )

    def _show_link(self) -> None:
        url = self.ctx.links.get("mlflow")
        if url:
            value = f'MLflow run: <a href="{html.escape(url, quote=True)}" target="_blank">{html.escape(url)}</a>'
        else:
            value = '<span style="color:gray">MLflow run: not recorded</span>'
        if self.link.value != value:
            self.link.value = value
