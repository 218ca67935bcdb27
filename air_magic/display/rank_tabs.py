"""The panel's tab per rank (and, once a profile was asked for, a Profile tab after them): its title (state, quiet,
at a breakpoint, the watch's badge), the usage line and the step-times line at its top, and the tail of its output,
refreshed at most every REFRESH seconds.

Part of the panel (widgets.py), which holds one `RankTabs` and calls it from the runner's thread only. It keeps each
rank's output in a bounded tail (display/tail.py) and takes the stacks the ranks print out of it (launch/stacks.py).
Not for the header (header.py) nor for deciding when to redraw (the panel's poll).
"""

from __future__ import annotations

import html
import time
from pathlib import Path

import ipywidgets as w

from ..job import RankState
from ..launch.files.stack_dumps import STOPPING, Dump, StackScanner
from ..resources import Peak, Usage, peak_text, usage_text
from .tail import TailBuffer

_LOG_STYLE = (
    "max-height:22em;overflow-y:auto;display:flex;flex-direction:column-reverse;"
    "font-family:var(--jp-code-font-family,monospace);font-size:12px;line-height:1.35;"
    "padding:4px 6px;background:var(--jp-layout-color1,#fff)"
)
_NOWRAP = "white-space:nowrap;overflow:hidden;text-overflow:ellipsis"
_USAGE_STYLE = "font-size:12px;color:var(--jp-ui-font-color2,#616161);padding:2px 6px;" + _NOWRAP


def tab_title(rank: int, state: RankState, quiet: float | None = None, at_prompt: bool = False) -> str:
    if at_prompt and state == RankState.RUNNING:
        return f"rank {rank}: at a breakpoint"
    if quiet is not None and state == RankState.RUNNING:
        return f"rank {rank}: {state.value} · quiet {quiet:.0f} s"
    return f"rank {rank}: {state.value}"


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


class RankTabs:
    """A tab per rank of one attempt's world, with what the panel knows of each rank."""

    def __init__(self, n: int, log_paths: list[Path] | None, usage_shown: bool) -> None:
        self.log_paths = log_paths
        self.tails = [TailBuffer() for _ in range(n)]
        self.scanners = [StackScanner() for _ in range(n)]
        #: Each rank's newest stacks: its own process first, then its children.
        self.dumps: dict[int, list[Dump]] = {}
        self.stacks_dirty = False
        self.states = [RankState.PENDING] * n
        self.last_output = [time.monotonic()] * n
        self.quiet: list[float | None] = [None] * n
        self.dirty: set[int] = set()
        #: The watch's word for a rank ("hung", "straggler (...)"), shown on its tab.
        self.badges: dict[int, str] = {}
        self.logs = [w.HTML(value=self._log_html(r), layout=w.Layout(width="100%")) for r in range(n)]
        shown = None if usage_shown else "none"  # see resources.py
        self.usages = [w.HTML(layout=w.Layout(width="100%", display=shown)) for _ in range(n)]
        for usage in self.usages:
            usage.add_class("air-magic-usage")
        self.step_lines = [w.HTML(layout=w.Layout(width="100%", display="none")) for _ in range(n)]
        for line in self.step_lines:
            line.add_class("air-magic-steps")
        self.pages = [w.VBox([usage, line, log]) for usage, line, log in zip(self.usages, self.step_lines, self.logs)]
        self.tabs = w.Tab(children=self.pages, titles=tuple(tab_title(r, RankState.PENDING) for r in range(n)))

    @property
    def widgets(self) -> list[w.Widget]:
        return [self.tabs, *self.pages, *self.usages, *self.step_lines, *self.logs]

    def show_profile(self, view: w.Widget) -> None:
        """The Profile tab, after the ranks' tabs: added with `view` (the profile's table) the first time, and
        selected each time a new profile is shown, so the click's answer is in front."""
        if view not in self.tabs.children:
            self.tabs.children = (*self.tabs.children, view)
            self.tabs.set_title(len(self.tabs.children) - 1, "Profile")
        self.tabs.selected_index = self.tabs.children.index(view)

    def feed(self, rank: int, text: str, final: bool = False) -> None:
        """A rank's output: stacks in it are taken out (`dumps`), the rest goes to its tail."""
        text, dumps = self.scanners[rank].feed(text, final=final)
        if dumps:
            self.take_dumps(rank, dumps)
        if text:
            self.tails[rank].feed(text)
            self.dirty.add(rank)
            if text.strip() and not dumps and not final:
                self.last_output[rank] = time.monotonic()

    def take_dumps(self, rank: int, dumps: list[Dump]) -> None:
        """Keep the newest stacks of each process of the rank: its own first, then its children's. Once the rank has
        stacks taken before stopping it, those stay: a request answered later (a Stacks click racing the stop) does
        not replace what the record keeps."""
        kept = {d.pid: d for d in self.dumps.get(rank, [])}
        if any(d.why == STOPPING for d in kept.values()):
            dumps = [d for d in dumps if d.why == STOPPING]
            if not dumps:
                return
        for dump in dumps:
            if dump.of_rank:
                kept = {}  # a new request: children not heard from again are gone
            kept[dump.pid] = dump
        self.dumps[rank] = sorted(kept.values(), key=lambda d: not d.of_rank)
        self.stacks_dirty = True

    def set_state(self, rank: int, state: RankState) -> None:
        self.states[rank] = state
        self.last_output[rank] = time.monotonic()
        self.quiet[rank] = None
        self.titled(rank, tab_title(rank, state))

    def mark_attempt(self, marker: str) -> None:
        """A new attempt starts: every tail gets the line the ranks' log files have."""
        for rank, tail in enumerate(self.tails):
            tail.feed(("" if not tail.partial else "\n") + marker)
            self.dirty.add(rank)

    def mark_prompts(self, at_prompt: set[int], before: set[int]) -> None:
        for rank in at_prompt ^ before:
            self.titled(rank, tab_title(rank, self.states[rank], self.quiet[rank], rank in at_prompt))

    def mark_quiet(self, now: float, after: float, at_prompt: set[int]) -> None:
        """Mark running ranks that printed nothing for `after` seconds (every 10 s more, the title says so)."""
        for rank, state in enumerate(self.states):
            silent = now - self.last_output[rank]
            quiet = silent if state == RankState.RUNNING and silent >= after else None
            if (quiet is None) != (self.quiet[rank] is None) or (quiet or 0) // 10 != (self.quiet[rank] or 0) // 10:
                self.quiet[rank] = quiet
                self.titled(rank, tab_title(rank, state, quiet, rank in at_prompt))

    def badge(self, rank: int, word: str, at_prompt: set[int]) -> None:
        if not 0 <= rank < len(self.states):
            return  # a command's rank beyond the run's units has no tab (docs/cli.md)
        self.badges[rank] = word
        self.titled(rank, tab_title(rank, self.states[rank], self.quiet[rank], rank in at_prompt))

    def titled(self, rank: int, title: str) -> None:
        """Set a rank's tab title, with its watch badge ("⚠ straggler", "⚠ hung") once it has one."""
        badge = self.badges.get(rank)
        self.tabs.set_title(rank, f"{title} · ⚠ {badge}" if badge else title)

    def flush(self) -> None:
        for rank in sorted(self.dirty):
            self.logs[rank].value = self._log_html(rank)
        self.dirty.clear()

    def show_usage(self, latest: dict[int, Usage], peaks: dict[int, Peak]) -> None:
        """Each rank's usage line, from the sampler's newest sample (or its peak, once the rank exited)."""
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

    def show_steps(self, step_times: dict[int, dict[str, float]]) -> None:
        """Each rank's recent step times, a small table at the top of its tab."""
        for rank, times in step_times.items():
            if rank < len(self.step_lines) and times.get("steps"):
                value = step_times_html(times)
                if self.step_lines[rank].value != value:
                    self.step_lines[rank].value = value
                    self.step_lines[rank].layout.display = None

    def _log_html(self, rank: int) -> str:
        tail = self.tails[rank]
        path = str(self.log_paths[rank]) if self.log_paths is not None else None
        # the note stays above the scrolling area, which is pinned to its newest line
        return (
            f'<div class="air-magic-log" data-rank="{rank}">{tail.note_html(path)}'
            f'<div style="{_LOG_STYLE}"><div>{tail.body_html()}</div></div></div>'
        )
