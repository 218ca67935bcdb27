"""The live panel shown in Jupyter: a tab per rank, status, elapsed time, MLflow link, Cancel, metric charts.

It is a runner
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
The header's buttons (Stacks, Stop, Cancel) come from one factory (header.py).
The Stop click, the same way, only leaves the call's Stop flag (stopping.py),
which the ranks' `should_stop()` reads: the call goes on to the end of its step.
The Stacks click, the same way, only asks the runner for every rank's stacks.
The Profile click profiles the next steps of every rank (display/profile.py); the table shows in a Profile tab
after the ranks' tabs.
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

This module is the listener: it builds the panel and decides when each part is redrawn. The rank's tabs are
drawn by rank_tabs.py, the header and the views under it by header.py; with this module they are the only ones
of air_magic that import ipywidgets. Not for the plain-text display (text.py) nor the record (record.py).

Over 300 lines because every runner hook redraws several parts of the panel, and when each part is redrawn is
decided in one place.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ipywidgets as w
from IPython.display import display

from ..job import JobResult, JobSpec, RankState
from ..launch.files import debug_channel
from ..launch.files.rundir import attempt_marker
from ..listeners import Listener, RunContext
from ..phase import Phase
from ..resources import ResourceSampler, header_text
from ..stopping import request_stop
from . import busy
from .cancel_route import keep_on_main_shell
from .charts import MetricsTail, charts_html
from .header import Header, link_html, stacks_html, status_html, usage_html, watch_alerts_html
from .profile import PanelProfiling
from .rank_tabs import RankTabs, tab_title
from .record import ended_as, record_bundle
from .starting import waiting_for

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


class Panel(Listener):
    """One call's panel; build it with `Panel(spec)` (shown at once) and hand it to the runner as a listener."""

    box: w.VBox
    ranks: RankTabs
    status: w.HTML
    link: w.HTML
    controls: w.HBox
    charts: w.HTML
    cancel_button: w.Button
    cancel_hint: w.HTML
    stacks_button: w.Button
    stop_button: w.Button
    stacks_view: w.HTML
    alerts_view: w.HTML
    alerts_shown: int
    collectives: str | None
    last_flush: float
    last_clock: float
    last_charts: float
    last_usage: float
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
        self.ranks.feed(rank, text)

    def on_rank_state(self, rank: int, state: RankState) -> None:
        if self.awaiting_ranks and state == RankState.RUNNING:
            self.phase = Phase.RUNNING
            self.awaiting_ranks = self.waiting = False
            self._show_status()
        self.ranks.set_state(rank, state)

    def on_attempt(self, attempt: int, why: str) -> None:
        assert self.ctx is not None
        self.ranks.mark_attempt(attempt_marker(attempt, self.ctx.attempts_allowed, why))  # as the rank's log has it
        self.phase = "starting again"
        self.awaiting_ranks, self.waiting = True, False
        self._show_status()

    def _mark_prompts(self) -> None:
        """Say which ranks wait at a debugger prompt, in their tabs and the status line."""
        assert self.ctx is not None
        at_prompt = set(debug_channel.waiting(self.ctx.run_dir, len(self.ranks.states)))
        if at_prompt != self.at_prompt:
            self.ranks.mark_prompts(at_prompt, self.at_prompt)
            self.at_prompt = at_prompt
            self._show_status()

    def poll(self) -> None:
        now = time.monotonic()
        if self.ranks.dirty and now - self.last_flush >= self.refresh:
            self.ranks.flush()
            self.last_flush = now
        assert self.ctx is not None
        if self.ctx.collectives != self.collectives:
            self.collectives = self.ctx.collectives
            self.ranks.stacks_dirty = True
        if self.ranks.stacks_dirty:
            self.ranks.stacks_dirty = False
            self.stacks_view.value = stacks_html(self.ranks.dumps, self.collectives)
            self.stacks_view.layout.display = None
        if self.ctx.stop_requested and not self.stop_button.disabled:
            self._show_stopping()
        profiled = self.profiling.take()  # the Profile button's view (display/profile.py), in its own tab
        if profiled is not None:
            self.profile_view.value = profiled
            self.ranks.show_profile(self.profile_view)
        self.profile_button.disabled = self.profiling.busy
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
            self.ranks.mark_quiet(now, QUIET, self.at_prompt)
            self._mark_prompts()
            self._show_watch()
        if self.resources is not None and now - self.last_usage >= USAGE:
            self.last_usage = now
            self._show_usage()
        self._show_link()

    def on_end(self, result: JobResult) -> None:
        assert self.ctx is not None
        for r in range(len(self.ranks.tails)):
            self.ranks.feed(r, "", final=True)
        self.ranks.dirty.update(range(len(self.ranks.tails)))
        self.ranks.flush()
        if self.metrics is not None:
            self.metrics.poll()
        for rank in result.ranks:
            self.ranks.titled(rank.rank, tab_title(rank.rank, rank.state))
        self.phase = ended_as(result)
        self.awaiting_ranks = self.waiting = False
        self.cancel_button.disabled = True
        self.usage_header = ""
        self.stacks_button.disabled = True
        self.profile_button.disabled, self.ended = True, True
        self.stop_button.disabled = True
        self.stop_button.layout.visibility = "hidden"
        self._show_watch()
        if self.ctx.collectives != self.collectives:
            self.collectives = self.ctx.collectives
            self.stacks_view.value = stacks_html(self.ranks.dumps, self.collectives)
        if self.phase == "cancelled":
            self.cancel_button.description = "Cancelled"
        else:
            self.cancel_button.layout.visibility = "hidden"  # keeps the header's layout steady
        self._show_status(result.elapsed)
        self._show_link()
        if result.profile is None and self.profiling.profiles:  # the record keeps what the Profile button found
            result = dataclasses.replace(result, profile=self.profiling.profiles[-1])
        bundle = record_bundle(
            result,
            self.ranks.tails,
            self.ctx.log_paths,
            self.ctx.links.get("mlflow"),
            self.metrics,
            self.ranks.dumps,
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
        usage_shown = self.resources is not None and spec.num_nodes == 1  # see resources.py
        self.ranks = RankTabs(spec.world_size, self.ctx.log_paths if self.ctx is not None else None, usage_shown)
        self.last_flush = 0.0
        self.last_clock = 0.0
        self.last_charts = 0.0
        self.last_usage = 0.0
        self.metrics = None
        self.started = time.monotonic()
        self.phase = "starting"
        self.awaiting_ranks, self.waiting = True, False
        self.alerts_shown = 0
        self.alerts_view = w.HTML(layout=w.Layout(display="none", width="100%"))
        self.alerts_view.add_class("air-magic-alerts")
        self.stacks_view = w.HTML(layout=w.Layout(display="none", width="100%"))
        self.collectives = None
        profilable = spec.watch and spec.num_nodes == 1  # the ranks' watch reads a profile request from the run dir
        made = Header(self._stacks_now, self._stop_now, self._cancel_now, self._profile_now if profilable else None)
        self.status, self.link, self.controls, self.cancel_hint = made.status, made.link, made.controls, made.hint
        self.stacks_button, self.stop_button, self.cancel_button = made.stacks, made.stop, made.cancel
        self.profile_button, self.profiling, self.ended = made.profile, PanelProfiling(), False
        self.profile_view = w.HTML(layout=w.Layout(width="100%"))  # the Profile tab's page, once there is one
        self.profile_view.add_class("air-magic-profile")
        header = made.box
        self.charts = w.HTML(layout=w.Layout(display="none", width="100%"))
        self.box = w.VBox([header, self.alerts_view, self.charts, self.stacks_view, self.ranks.tabs])
        self.box.add_class("air-magic-panel")
        self._widgets: list[Any] = [
            self.box,
            header,
            self.charts,
            self.stacks_view,
            self.profile_view,
            *self.ranks.widgets,
            self.alerts_view,
            *made.widgets,
        ]
        for widget in self._widgets:
            if widget not in made.buttons:  # routed by header.button()
                keep_on_main_shell(widget)

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

    def _profile_now(self) -> None:
        # On the shell-channel thread: only leave the request (one small file) and start the thread that waits for
        # the ranks' traces (display/profile.py); poll() draws what it finds.
        if self.ctx is not None:
            ctx = self.ctx
            self.profiling.ask(ctx.run_dir, ctx.spec.world_size, ctx.spec.watch, lambda: not self.ended)

    def _stacks_now(self) -> None:
        # On the shell-channel thread, like a cancel: only ask; the stacks arrive as the ranks' output.
        if self.ctx is not None:
            self.ctx.ask_stacks()

    def _show_status(self, elapsed: float | None = None) -> None:
        spec = self.spec
        assert spec is not None
        if elapsed is None:
            elapsed = self.ctx.elapsed if self.ctx is not None else time.monotonic() - self.started
        self.last_clock = time.monotonic()
        self.status.value = status_html(spec, self.phase, elapsed, self.ctx, self.usage_header, self.at_prompt)

    def _show_usage(self) -> None:
        """Redraw each rank's usage line and the header's figure from the sampler's newest sample."""
        assert self.resources is not None
        if self.resources.count == self.usage_seen:
            return
        self.usage_seen = self.resources.count
        latest = self.resources.latest()
        self.ranks.show_usage(latest, self.resources.peaks())
        header = usage_html(*header_text(latest, self.resources.node_memory_percent))
        if header != self.usage_header:
            self.usage_header = header
            self._show_status()

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
                word = {"hang": "hung", "straggler": f"straggler ({alert.cause})"}.get(alert.kind, alert.kind)
                self.ranks.badge(alert.rank, word, self.at_prompt)
        self.ranks.show_steps(self.ctx.step_times)

    def _show_link(self) -> None:
        url = self.ctx.links.get("mlflow") if self.ctx is not None else None
        value = link_html(url, self.spec is not None and self.spec.mlflow, self.awaiting_ranks)
        if self.link.value != value:
            self.link.value = value
