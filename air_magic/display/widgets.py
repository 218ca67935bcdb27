"""The live panel shown in Jupyter: a tab per rank, status, elapsed time, MLflow link, Cancel, metric charts.

The only module of air_magic that imports ipywidgets. It is a runner
listener: every hook runs on the thread that made the call, so widgets are
only changed from that thread. Output is kept in a bounded tail per rank
(display/tail.py) and sent to the browser at most every REFRESH seconds, so
a flooding rank cannot drown the kernel or the browser; the full log stays
in the run directory. Metrics the ranks log are read from their files in the
run directory (display/charts.py) and drawn as small charts. The Cancel click
is recognized on the kernel's shell-channel thread (display/cancel_route.py)
and only sets the call's cancel flag. What each rank uses (CPU, memory, its
GPU) is read from the call's ResourceSampler (resources.py) once a second:
a line at the top of each rank's tab, and the fullest GPU's memory (or the
ranks' memory) in the header, coloured when it nears the limit.
The header's buttons (Stacks, Stop, Cancel) come from one factory (`Panel._button`).
The Stop click, the same way, only leaves the call's Stop flag (stopping.py),
which the ranks' `should_stop()` reads: the call goes on to the end of its step.
The Stacks click, the same way, only asks the runner for every rank's stacks.
Those arrive in the ranks' output (launch/stacks.py): each rank's tab shows one
line in their place, and the stacks view under the header shows them, innermost
frame last. A running rank that has printed nothing for QUIET seconds is marked
quiet in its tab's title.

The panel takes the place of the starting line that make_display() shows
the moment a call begins, and appears before the MLflow run exists or any
process starts, with its phase saying what it waits for. When the call ends,
the panel's output is replaced by a static record (display/record.py) that
needs no kernel and no widget state, so the saved notebook keeps it. While a
call runs, display/busy.py keeps the kernel reading `busy`.

Over 300 lines because it is the one module that imports ipywidgets, so the whole panel (tabs, buttons, charts,
record) lives here.
"""

from __future__ import annotations

import html
import time
from typing import Any

import ipywidgets as w
from IPython.display import display

from ..job import Alert, JobResult, JobSpec, RankState
from ..launch.files import debug_channel
from ..launch.files.rundir import attempt_marker
from ..launch.files.stack_dumps import Dump, StackScanner
from ..listeners import Listener, RunContext
from ..phase import Phase
from ..resources import ResourceSampler, header_text, peak_text, usage_text
from ..stopping import request_stop
from . import busy
from .cancel_route import keep_on_main_shell
from .charts import MetricsTail, charts_html
from .record import ended_as, record_bundle, short_link_text
from .starting import waiting_for
from .tail import TailBuffer

#: Seconds between two refreshes of a rank's tab (the browser sees at most this rate).
REFRESH = 0.1
#: Seconds between two updates of the clock.
CLOCK = 0.5
#: Seconds between two redraws of the metric charts.
CHARTS = 0.5
#: Seconds between two redraws of what the ranks use (the sampler takes a sample about as often).
USAGE = 0.5
#: A running rank that has printed nothing for this many seconds is marked quiet.
QUIET = 60.0

_LOG_STYLE = (
    "max-height:22em;overflow-y:auto;display:flex;flex-direction:column-reverse;"
    "font-family:var(--jp-code-font-family,monospace);font-size:12px;line-height:1.35;"
    "padding:4px 6px;background:var(--jp-layout-color1,#fff)"
)
_NOWRAP = "white-space:nowrap;overflow:hidden;text-overflow:ellipsis"
#: The status line has a row of its own and wraps rather than cut what it says (a narrow notebook, a long name).
_STATUS_STYLE = "white-space:normal;overflow-wrap:anywhere"
_USAGE_STYLE = "font-size:12px;color:var(--jp-ui-font-color2,#616161);padding:2px 6px;" + _NOWRAP
_STACK_STYLE = (
    "margin:0;padding:4px 6px;white-space:pre;overflow-x:auto;max-height:24em;overflow-y:auto;font-size:12px;"
    "line-height:1.35;background:var(--jp-layout-color2,#f7f7f7)"
)


def _title(rank: int, state: RankState, quiet: float | None = None, at_prompt: bool = False) -> str:
    if at_prompt and state == RankState.RUNNING:
        return f"rank {rank}: at a breakpoint"
    if quiet is not None and state == RankState.RUNNING:
        return f"rank {rank}: {state.value} · quiet {quiet:.0f} s"
    return f"rank {rank}: {state.value}"


def watch_alerts_html(alerts: list[Alert]) -> str:
    """One line per alert of the watch, newest last."""
    lines = "".join(
        f'<div class="air-magic-alert" data-kind="{a.kind}" data-rank="{a.rank}">⚠ {html.escape(a.message)}</div>'
        for a in alerts
    )
    return f'<div style="font-size:12px;color:#b26a00;padding:2px 6px">{lines}</div>'


def step_times_html(times: dict[str, float]) -> str:
    """A rank's recent steps on average: a one-row table of input, compute and collective seconds per step."""
    cells = "".join(
        f'<td style="padding:0 8px">{label} {times[key] * 1000:.1f} ms</td>'
        for label, key in (("step", "step"), ("input", "input"), ("compute", "compute"), ("collective", "collective"))
    )
    return (
        f'<table style="{_USAGE_STYLE};border-collapse:collapse"><tr><td style="padding:0 8px 0 0">'
        f"{times['steps']:.0f} steps, each on average:</td>{cells}</tr></table>"
    )


def stacks_html(dumps: dict[int, list[Dump]], collectives: str | None = None) -> str:
    """Each rank's newest stacks (its own process, then its children): where it is, then every thread; first, what
    NCCL's flight recorder says of the collectives, where it said something."""
    parts = ['<div class="air-magic-stacks">']
    if collectives:
        parts.append(f'<div class="air-magic-collectives">NCCL\'s flight recorder: {html.escape(collectives)}</div>')
    for rank in sorted(dumps):
        for dump in dumps[rank]:
            frame = dump.user_frame()
            where = f"in {frame.where()}" if frame is not None else "in no user code"
            who = "" if dump.of_rank else f" · pid {dump.pid}, {dump.role}"
            parts.append(
                f'<details class="air-magic-stacks-rank" style="margin:2px 0"><summary style="cursor:pointer">'
                f"rank {rank}{html.escape(who)}: {html.escape(where)} · {html.escape(dump.why)} at {dump.clock}"
                f'</summary><pre style="{_STACK_STYLE}">{html.escape(dump.text())}</pre></details>'
            )
    parts.append("</div>")
    return "".join(parts)


class Panel(Listener):
    """One call's panel; build it with `Panel(spec)` (shown at once) and hand it to the runner as a listener."""

    box: w.VBox
    tabs: w.Tab
    logs: list[w.HTML]
    status: w.HTML
    link: w.HTML
    controls: w.HBox
    charts: w.HTML
    cancel_button: w.Button
    cancel_hint: w.HTML
    stacks_button: w.Button
    stop_button: w.Button
    stacks_view: w.HTML
    collectives: str | None
    scanners: list[StackScanner]
    dumps: dict[int, list[Dump]]
    stacks_dirty: bool
    states: list[RankState]
    last_output: list[float]
    quiet: list[float | None]
    tails: list[TailBuffer]
    dirty: set[int]
    last_flush: float
    last_clock: float
    last_charts: float
    last_usage: float
    usages: list[w.HTML]
    metrics: MetricsTail | None
    handle: Any

    def __init__(
        self, starting: Any = None, refresh: float = REFRESH, resources: ResourceSampler | None = None
    ) -> None:
        self.starting = starting  # display.StartingLine whose place the panel takes, if one was shown
        self.refresh = refresh
        self.resources = resources
        self.usage_seen = -1  # the sampler's sample count last drawn
        self.usage_header = ""
        self.spec: JobSpec | None = None
        self.ctx: RunContext | None = None
        self.phase = "starting"  # the status line's words
        self.awaiting_ranks = True  # no rank of this attempt runs yet (and the call is not ending)
        self.waiting = False  # the status line says what the start waits for (waiting_for), so phases update it
        self.at_prompt: set[int] = set()  # ranks waiting at a debugger prompt (a background call's: attach to them)

    # -- runner hooks ------------------------------------------------------
    def on_start(self, ctx: RunContext) -> None:
        # Shown at once: the MLflow run is still being made (tracking.py does that in the background)
        # and no process has started yet, so the line says what the call waits for.
        busy.hold()
        self.ctx = ctx
        self.spec = ctx.spec
        self._build(ctx.spec)
        self.metrics = MetricsTail(ctx.run_dir, ctx.spec.world_size) if ctx.spec.mlflow else None
        self.phase = waiting_for(ctx.spec, ctx.phase, run_made=bool(ctx.links.get("mlflow")))
        self.waiting = True
        self._show_status()
        self._show_link()
        if self.starting is not None:
            self.starting.taken = True
            self.handle = self.starting.handle
            self.handle.update(self.box)
        else:
            self.handle = display(self.box, display_id=True)

    def on_phase(self, phase: Phase) -> None:
        if self.spec is not None and self.waiting:
            self.phase = waiting_for(self.spec, phase)  # after on_start: the launcher's phase, then its ranks
            self._show_status()

    def on_output(self, rank: int, text: str) -> None:
        text, dumps = self.scanners[rank].feed(text)
        if dumps:
            self._take_dumps(rank, dumps)
        if text:
            self.tails[rank].feed(text)
            self.dirty.add(rank)
            if text.strip() and not dumps:
                self.last_output[rank] = time.monotonic()

    def on_rank_state(self, rank: int, state: RankState) -> None:
        if self.awaiting_ranks and state == RankState.RUNNING:
            self.phase = Phase.RUNNING
            self.awaiting_ranks = self.waiting = False
            self._show_status()
        self.states[rank] = state
        self.last_output[rank] = time.monotonic()
        self.quiet[rank] = None
        self._titled(rank, _title(rank, state))

    def on_attempt(self, attempt: int, why: str) -> None:
        assert self.ctx is not None
        marker = attempt_marker(attempt, self.ctx.attempts_allowed, why)
        for rank, tail in enumerate(self.tails):
            tail.feed(("" if not tail.partial else "\n") + marker)  # as the rank's log file has it
            self.dirty.add(rank)
        self.phase = "starting again"
        self.awaiting_ranks, self.waiting = True, False
        self._show_status()

    def _take_dumps(self, rank: int, dumps: list[Dump]) -> None:
        """Keep the newest stacks of each process of the rank: its own first, then its children's."""
        kept = {d.pid: d for d in self.dumps.get(rank, [])}
        for dump in dumps:
            if dump.of_rank:
                kept = {}  # a new request: children not heard from again are gone
            kept[dump.pid] = dump
        self.dumps[rank] = sorted(kept.values(), key=lambda d: not d.of_rank)
        self.stacks_dirty = True

    def _mark_prompts(self) -> None:
        """Say which ranks wait at a debugger prompt, in their tabs and the status line."""
        assert self.ctx is not None
        at_prompt = set(debug_channel.waiting(self.ctx.run_dir, len(self.states)))
        if at_prompt != self.at_prompt:
            for rank in at_prompt ^ self.at_prompt:
                self._titled(rank, _title(rank, self.states[rank], self.quiet[rank], rank in at_prompt))
            self.at_prompt = at_prompt
            self._show_status()

    def _mark_quiet(self, now: float) -> None:
        for rank, state in enumerate(self.states):
            silent = now - self.last_output[rank]
            quiet = silent if state == RankState.RUNNING and silent >= QUIET else None
            if (quiet is None) != (self.quiet[rank] is None) or (quiet or 0) // 10 != (self.quiet[rank] or 0) // 10:
                self.quiet[rank] = quiet
                self._titled(rank, _title(rank, state, quiet, rank in self.at_prompt))

    def poll(self) -> None:
        now = time.monotonic()
        if self.dirty and now - self.last_flush >= self.refresh:
            self._flush()
            self.last_flush = now
        assert self.ctx is not None
        if self.ctx.collectives != self.collectives:
            self.collectives = self.ctx.collectives
            self.stacks_dirty = True
        if self.stacks_dirty:
            self.stacks_dirty = False
            self.stacks_view.value = stacks_html(self.dumps, self.collectives)
            self.stacks_view.layout.display = None
        if self.ctx.stop_requested and not self.stop_button.disabled:
            self._show_stopping()
        if self.metrics is not None and now - self.last_charts >= CHARTS:
            self.last_charts = now
            if self.metrics.poll():
                self.charts.value = charts_html(self.metrics)
                self.charts.layout.display = None
        assert self.ctx is not None
        if self.ctx.cancelled and not self.cancel_button.disabled:
            self.phase = "cancelling"
            self.awaiting_ranks = self.waiting = False
            self.cancel_button.disabled = True
            self.cancel_button.description = "Cancelling…"
            self._show_status()
        elif now - self.last_clock >= CLOCK:
            self._show_status()
            self._mark_quiet(now)
            self._mark_prompts()
            self._show_watch()
        if self.resources is not None and now - self.last_usage >= USAGE:
            self.last_usage = now
            self._show_usage()
        self._show_link()

    def on_end(self, result: JobResult) -> None:
        assert self.ctx is not None
        for r, scanner in enumerate(self.scanners):
            text, dumps = scanner.feed("", final=True)
            if dumps:
                self._take_dumps(r, dumps)
            if text:
                self.tails[r].feed(text)
        self.dirty.update(range(len(self.tails)))
        self._flush()
        if self.metrics is not None:
            self.metrics.poll()
        for rank in result.ranks:
            self._titled(rank.rank, _title(rank.rank, rank.state))
        self.phase = ended_as(result)
        self.awaiting_ranks = self.waiting = False
        self.cancel_button.disabled = True
        self.usage_header = ""
        self.stacks_button.disabled = True
        self.stop_button.disabled = True
        self.stop_button.layout.visibility = "hidden"
        self._show_watch()
        if self.ctx.collectives != self.collectives:
            self.collectives = self.ctx.collectives
            self.stacks_view.value = stacks_html(self.dumps, self.collectives)
        if self.phase == "cancelled":
            self.cancel_button.description = "Cancelled"
        else:
            self.cancel_button.layout.visibility = "hidden"  # keeps the header's layout steady
        self._show_status(result.elapsed)
        self._show_link()
        bundle = record_bundle(
            result,
            self.tails,
            self.ctx.log_paths,
            self.ctx.links.get("mlflow"),
            self.metrics,
            self.dumps,
            peaks=self.resources.peaks() if self.resources is not None else None,
        )
        # The widget's output becomes the static record: a saved or converted notebook keeps it.
        try:
            self.handle.update(bundle, raw=True)
            for widget in self._widgets:
                widget.close()
        finally:
            busy.release()

    # -- drawing -----------------------------------------------------------
    def _build(self, spec: JobSpec) -> None:
        n = spec.world_size
        self.tails = [TailBuffer() for _ in range(n)]
        self.scanners = [StackScanner() for _ in range(n)]
        self.dumps = {}
        self.stacks_dirty = False
        self.states = [RankState.PENDING] * n
        self.last_output = [time.monotonic()] * n
        self.quiet = [None] * n
        self.dirty = set()
        self.last_flush = 0.0
        self.last_clock = 0.0
        self.last_charts = 0.0
        self.last_usage = 0.0
        self.metrics = None
        self.started = time.monotonic()
        self.phase = "starting"
        self.awaiting_ranks, self.waiting = True, False
        self.logs = [w.HTML(value=self._log_html(r), layout=w.Layout(width="100%")) for r in range(n)]
        shown = None if self.resources is not None and spec.num_nodes == 1 else "none"  # see resources.py
        self.usages = [w.HTML(layout=w.Layout(width="100%", display=shown)) for _ in range(n)]
        for usage in self.usages:
            usage.add_class("air-magic-usage")
        self.step_lines = [w.HTML(layout=w.Layout(width="100%", display="none")) for _ in range(n)]
        for line in self.step_lines:
            line.add_class("air-magic-steps")
        self.badges: dict[int, str] = {}
        self.alerts_shown = 0
        self.alerts_view = w.HTML(layout=w.Layout(display="none", width="100%"))
        self.alerts_view.add_class("air-magic-alerts")
        pages = [w.VBox([usage, line, log]) for usage, line, log in zip(self.usages, self.step_lines, self.logs)]
        self.tabs = w.Tab(children=pages, titles=tuple(_title(r, RankState.PENDING) for r in range(n)))
        self.status = w.HTML(layout=w.Layout(width="100%", margin="0"))  # no margin: as wide as the header
        self.status.add_class("air-magic-status")
        self.link = w.HTML(layout=w.Layout(flex="1 1 auto", min_width="0"))
        self.link.add_class("air-magic-link")
        # made before Cancel: a frontend lists buttons in the order they were made, Cancel stays the last
        self.stacks_button = self._button(
            "Stacks",
            "search",
            "Show where every rank is now, stopping nothing",
            "air-magic-stacks-button",
            self._stacks_now,
        )
        self.stacks_view = w.HTML(layout=w.Layout(display="none", width="100%"))
        self.collectives = None
        self.stop_button = self._button(
            "Stop",
            "step-forward",
            "Stop after this step: air_magic.should_stop() turns True on every rank, the call returns normally",
            "air-magic-stop",
            self._stop_now,
            min_width="8.5em",
        )
        # wide enough for "Cancelling…" with its icon
        self.cancel_button = self._button(
            "Cancel",
            "stop",
            "Stop every rank of this call",
            "air-magic-cancel",
            self._cancel_now,
            min_width="9.5em",
            style="danger",
        )
        self.cancel_hint = w.HTML(layout=w.Layout(flex="0 1 auto"))
        if self.cancel_button.layout.display == "none":
            self.cancel_hint.value = "<i>Stop with the kernel's interrupt button (■).</i>"
        # The status line above, the link and the buttons in a row below: each keeps its room at any width.
        self.controls = w.HBox(
            [self.link, self.stacks_button, self.stop_button, self.cancel_button, self.cancel_hint],
            layout=w.Layout(align_items="center", width="100%", margin="0", flex_flow="row wrap", grid_gap="8px"),
        )
        header = w.VBox([self.status, self.controls], layout=w.Layout(width="100%"))
        header.add_class("air-magic-header")
        self.charts = w.HTML(layout=w.Layout(display="none", width="100%"))
        self.box = w.VBox([header, self.alerts_view, self.charts, self.stacks_view, self.tabs])
        self.box.add_class("air-magic-panel")
        self._widgets: list[Any] = [
            self.box,
            header,
            self.charts,
            self.stacks_view,
            self.tabs,
            *pages,
            *self.usages,
            *self.step_lines,
            self.alerts_view,
            *self.logs,
            self.status,
            self.controls,
            self.link,
            self.stacks_button,
            self.stop_button,
            self.cancel_button,
            self.cancel_hint,
        ]
        for widget in self._widgets:
            if widget not in (self.cancel_button, self.stacks_button, self.stop_button):  # routed by _button
                keep_on_main_shell(widget)

    @staticmethod
    def _button(
        label: str, icon: str, tooltip: str, css: str, now: Any, min_width: str | None = None, style: str = ""
    ) -> w.Button:
        """A header button whose click runs `now` on the kernel's shell-channel thread while the cell is busy
        (cancel_route.py), so `now` only sets a flag; where clicks cannot come then, the button is not shown."""
        button = w.Button(
            description=label,
            icon=icon,
            tooltip=tooltip,
            button_style=style,
            layout=w.Layout(width="auto", min_width=min_width, flex="0 0 auto"),  # never squeezed by the row
        )
        button.add_class(css)
        button.on_click(lambda _button: now())  # a click that comes once the cell is idle
        if not keep_on_main_shell(button, now):
            button.layout.display = "none"  # a click would only arrive after the call
        return button

    def _cancel_now(self) -> None:
        # Runs on the kernel's shell-channel thread while the cell is busy: only set the flag;
        # the runner stops the ranks and the next poll() redraws the button.
        if self.ctx is not None:
            self.ctx.cancel()

    def _stop_now(self) -> None:
        # On the shell-channel thread, like a cancel: only leave the flag (one small file); the ranks read it.
        if self.ctx is not None:
            request_stop(self.ctx.run_dir)
            self.ctx.stop_requested = True

    def _show_stopping(self) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping…"
        self.stop_button.tooltip = "Stop asked: each rank's should_stop() is True from its next step"
        if self.phase == Phase.RUNNING or self.phase == "running":
            self.phase = "stopping after this step"
            self._show_status()

    def _stacks_now(self) -> None:
        # On the shell-channel thread, like a cancel: only ask; the stacks arrive as the ranks' output.
        if self.ctx is not None:
            self.ctx.ask_stacks()

    def _log_html(self, rank: int) -> str:
        tail = self.tails[rank]
        path = str(self.ctx.log_paths[rank]) if self.ctx is not None else None
        # the note stays above the scrolling area, which is pinned to its newest line
        return (
            f'<div class="air-magic-log" data-rank="{rank}">{tail.note_html(path)}'
            f'<div style="{_LOG_STYLE}"><div>{tail.body_html()}</div></div></div>'
        )

    def _flush(self) -> None:
        for rank in sorted(self.dirty):
            self.logs[rank].value = self._log_html(rank)
        self.dirty.clear()

    def _show_status(self, elapsed: float | None = None) -> None:
        spec = self.spec
        assert spec is not None
        if elapsed is None:
            elapsed = self.ctx.elapsed if self.ctx is not None else time.monotonic() - self.started
        self.last_clock = time.monotonic()
        phase = html.escape(self.phase)
        self.status.value = (
            f'<div style="{_STATUS_STYLE}" '
            f'title="{html.escape(spec.name, quote=True)} · {phase}{html.escape(self._attempt_text(), quote=True)}">'
            f"<b>{html.escape(spec.name)}</b> · {spec.world_size} rank(s) · {html.escape(spec.accelerator_type)}"
            f"{'' if spec.session is None else f' · session {html.escape(spec.session)}'}"
            f' · <span class="air-magic-phase">{phase}</span>{self._attempt_html()}'
            f" · {elapsed:.0f} s{self.usage_header}{self._prompt_html()}</div>"
        )

    def _prompt_html(self) -> str:
        note = debug_channel.waiting_note(self.at_prompt)
        return f' · <span class="air-magic-breakpoint">{html.escape(note)}</span>' if note else ""

    def _show_usage(self) -> None:
        """Redraw each rank's usage line and the header's figure from the sampler's newest sample."""
        assert self.resources is not None
        if self.resources.count == self.usage_seen:
            return
        self.usage_seen = self.resources.count
        latest, peaks = self.resources.latest(), self.resources.peaks()
        for rank, widget in enumerate(self.usages):
            if rank in latest:
                text = usage_text(latest[rank])
            elif rank in peaks:
                text = f"exited · {peak_text(peaks[rank])}"
            else:
                continue
            value = f'<div style="{_USAGE_STYLE}">{html.escape(text)}</div>'
            if widget.value != value:
                widget.value = value
        words, near = header_text(latest, self.resources.node_memory_percent)
        color = "#c62828" if near else "inherit"
        span = f'<span class="air-magic-resources" style="color:{color}">{html.escape(words)}</span>'
        header = f" · {span}" if words else ""
        if header != self.usage_header:
            self.usage_header = header
            self._show_status()

    def _titled(self, rank: int, title: str) -> None:
        """Set a rank's tab title, with its watch badge ("⚠ straggler", "⚠ hung") once it has one."""
        badge = self.badges.get(rank)
        self.tabs.set_title(rank, f"{title} · ⚠ {badge}" if badge else title)

    def _show_watch(self) -> None:
        """New alerts of the watch (watching/): a line each above the tabs and a badge on the rank's tab; and each
        rank's recent step times, a small table at the top of its tab."""
        assert self.ctx is not None
        alerts = list(self.ctx.alerts)
        if len(alerts) != self.alerts_shown:
            self.alerts_shown = len(alerts)
            self.alerts_view.value = watch_alerts_html(alerts)
            self.alerts_view.layout.display = None
            for alert in alerts:
                self.badges[alert.rank] = "hung" if alert.kind == "hang" else f"straggler ({alert.cause})"
                state = self.states[alert.rank]
                self._titled(
                    alert.rank, _title(alert.rank, state, self.quiet[alert.rank], alert.rank in self.at_prompt)
                )
        for rank, times in self.ctx.step_times.items():
            if rank < len(self.step_lines) and times.get("steps"):
                value = step_times_html(times)
                if self.step_lines[rank].value != value:
                    self.step_lines[rank].value = value
                    self.step_lines[rank].layout.display = None

    def _attempt_text(self) -> str:
        """' · attempt 2 of 3 (after: why the last one ended)' once the call has restarted, else ''."""
        ctx = self.ctx
        if ctx is None or not ctx.attempt:
            return ""
        return f" · attempt {ctx.attempt + 1} of {ctx.attempts_allowed} (after: {ctx.earlier_failures[-1]})"

    def _attempt_html(self) -> str:
        text = self._attempt_text()
        return f'<span class="air-magic-attempt">{html.escape(text)}</span>' if text else ""

    def _show_link(self) -> None:
        url = self.ctx.links.get("mlflow") if self.ctx is not None else None
        if url:
            href = html.escape(url, quote=True)
            value = (
                f'<span style="white-space:nowrap">MLflow <a href="{href}" title="{href}" target="_blank">'
                f"{html.escape(short_link_text(url))}</a></span>"
            )
        elif self.spec is not None and self.spec.mlflow and self.awaiting_ranks:
            value = '<span style="color:gray;white-space:nowrap">MLflow run: …</span>'
        else:
            value = '<span style="color:gray;white-space:nowrap">MLflow run: not recorded</span>'
        if self.link.value != value:
            self.link.value = value
