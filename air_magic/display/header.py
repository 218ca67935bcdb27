"""The panel's header and the views under it: the status line, the MLflow link, the buttons (one factory), the watch's
alerts and the ranks' stacks.

Part of the panel (widgets.py): these functions make widgets and HTML; the panel decides when to draw them. A button's
click runs on the kernel's shell-channel thread while the cell is busy (cancel_route.py), so what it runs only sets a
flag. Not for the tabs of the ranks (rank_tabs.py) nor for the record left when the call ends (record.py).
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as w

from ..job import Alert, JobSpec
from ..launch.files import debug_channel
from ..launch.files.stack_dumps import Dump
from ..listeners import RunContext
from .cancel_route import keep_on_main_shell
from .record import short_link_text

#: The status line has a row of its own and wraps rather than cut what it says (a narrow notebook, a long name).
_STATUS_STYLE = "white-space:normal;overflow-wrap:anywhere"
_STACK_STYLE = (
    "margin:0;padding:4px 6px;white-space:pre;overflow-x:auto;max-height:24em;overflow-y:auto;font-size:12px;"
    "line-height:1.35;background:var(--jp-layout-color2,#f7f7f7)"
)


def button(
    label: str, icon: str, tooltip: str, css: str, now: Any, min_width: str | None = None, style: str = ""
) -> w.Button:
    """A header button whose click runs `now` on the kernel's shell-channel thread while the cell is busy
    (cancel_route.py), so `now` only sets a flag; where clicks cannot come then, the button is not shown."""
    made = w.Button(
        description=label,
        icon=icon,
        tooltip=tooltip,
        button_style=style,
        layout=w.Layout(width="auto", min_width=min_width, flex="0 0 auto"),  # never squeezed by the row
    )
    made.add_class(css)
    made.on_click(lambda _button: now())  # a click that comes once the cell is idle
    if not keep_on_main_shell(made, now):
        made.layout.display = "none"  # a click would only arrive after the call
    return made


class Header:
    """The header's widgets: the status line on a row of its own; under it the MLflow link, the Stacks, Profile (for
    a call `profile_now` can profile), Stop and Cancel buttons, and a hint where the buttons cannot be shown."""

    def __init__(self, stacks_now: Any, stop_now: Any, cancel_now: Any, profile_now: Any = None) -> None:
        self.status = w.HTML(layout=w.Layout(width="100%", margin="0"))  # no margin: as wide as the header
        self.status.add_class("air-magic-status")
        self.link = w.HTML(layout=w.Layout(flex="1 1 auto", min_width="0"))
        self.link.add_class("air-magic-link")
        # made before Cancel: a frontend lists buttons in the order they were made, Cancel stays the last
        self.stacks = button(
            "Stacks",
            "search",
            "Show where every rank is now, stopping nothing",
            "air-magic-stacks-button",
            stacks_now,
        )
        self.profile = button(
            "Profile",
            "tachometer",
            "Profile the next 5 steps of every rank with torch.profiler: the table and the merged trace show in a tab",
            "air-magic-profile-button",
            profile_now or (lambda: None),
        )
        if profile_now is None:
            self.profile.layout.display = "none"  # a call the watch does not count steps of
        self.stop = button(
            "Stop",
            "step-forward",
            "Stop after this step: air_magic.should_stop() turns True on every rank, the call returns normally",
            "air-magic-stop",
            stop_now,
            min_width="8.5em",
        )
        # wide enough for "Cancelling…" with its icon
        self.cancel = button(
            "Cancel",
            "stop",
            "Stop every rank of this call",
            "air-magic-cancel",
            cancel_now,
            min_width="9.5em",
            style="danger",
        )
        self.hint = w.HTML(layout=w.Layout(flex="0 1 auto"))
        if self.cancel.layout.display == "none":
            self.hint.value = "<i>Stop with the kernel's interrupt button (■).</i>"
        # The status line above, the link and the buttons in a row below: each keeps its room at any width.
        self.controls = w.HBox(
            [self.link, self.stacks, self.profile, self.stop, self.cancel, self.hint],
            layout=w.Layout(align_items="center", width="100%", margin="0", flex_flow="row wrap", grid_gap="8px"),
        )
        self.box = w.VBox([self.status, self.controls], layout=w.Layout(width="100%"))
        self.box.add_class("air-magic-header")
        self.buttons = (self.stacks, self.profile, self.stop, self.cancel)

    @property
    def widgets(self) -> list[w.Widget]:
        return [self.status, self.controls, self.link, *self.buttons, self.hint]


def status_html(
    spec: JobSpec, phase: str, elapsed: float, ctx: RunContext | None, usage: str, at_prompt: set[int]
) -> str:
    """The status line: name, ranks, accelerator, session, phase, attempt, seconds, usage, ranks at a prompt."""
    phase = html.escape(phase)
    attempt = attempt_text(ctx)
    attempt_html = f'<span class="air-magic-attempt">{html.escape(attempt)}</span>' if attempt else ""
    note = debug_channel.waiting_note(at_prompt)
    prompt = f' · <span class="air-magic-breakpoint">{html.escape(note)}</span>' if note else ""
    return (
        f'<div style="{_STATUS_STYLE}" '
        f'title="{html.escape(spec.name, quote=True)} · {phase}{html.escape(attempt, quote=True)}">'
        f"<b>{html.escape(spec.name)}</b> · {spec.world_size} rank(s) · {html.escape(spec.accelerator_type)}"
        f"{'' if spec.session is None else f' · session {html.escape(spec.session)}'}"
        f' · <span class="air-magic-phase">{phase}</span>{attempt_html}'
        f" · {elapsed:.0f} s{usage}{prompt}</div>"
    )


def attempt_text(ctx: RunContext | None) -> str:
    """' · attempt 2 of 3 (after: why the last one ended)' once the call has restarted, else ''."""
    if ctx is None or not ctx.attempt:
        return ""
    return f" · attempt {ctx.attempt + 1} of {ctx.attempts_allowed} (after: {ctx.earlier_failures[-1]})"


def usage_html(words: str, near: bool) -> str:
    """The header's figure of what the ranks use (resources.header_text), red when it nears the limit."""
    color = "#c62828" if near else "inherit"
    span = f'<span class="air-magic-resources" style="color:{color}">{html.escape(words)}</span>'
    return f" · {span}" if words else ""


def link_html(url: str | None, mlflow: bool, awaiting_ranks: bool) -> str:
    """The MLflow link, or what stands in its place: the run still being made, or not recorded."""
    if url:
        href = html.escape(url, quote=True)
        return (
            f'<span style="white-space:nowrap">MLflow <a href="{href}" title="{href}" target="_blank">'
            f"{html.escape(short_link_text(url))}</a></span>"
        )
    if mlflow and awaiting_ranks:
        return '<span style="color:gray;white-space:nowrap">MLflow run: …</span>'
    return '<span style="color:gray;white-space:nowrap">MLflow run: not recorded</span>'


def watch_alerts_html(alerts: list[Alert]) -> str:
    """One line per alert of the watch, newest last."""
    lines = "".join(
        f'<div class="air-magic-alert" data-kind="{a.kind}" data-rank="{a.rank}">⚠ {html.escape(a.message)}</div>'
        for a in alerts
    )
    return f'<div style="font-size:12px;color:#b26a00;padding:2px 6px">{lines}</div>'


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
