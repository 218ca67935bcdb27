"""Deliver a Cancel click while the kernel's main thread is busy running the cell, without a second shell.

A cell that calls the runner blocks the kernel's main thread until the job
ends, and ipykernel handles widget messages on that thread, so a click would
wait until the job is over. ipykernel 7 reads the shell channel in a thread
of its own and, for each comm message, asks the comm which (sub)shell should
handle it (`comm._reply_subshell_for(data, default)`), passing the message's
data. That question is asked at once, whatever the main thread is doing: so
the hook itself recognizes a click (`{"method": "custom", "content":
{"event": "click"}}`), calls `on_click` there, and still sends the message
on to the main shell, where ipywidgets handles it as usual once the cell is
done.

Why not a subshell: an earlier version routed the button's messages to a
kernel subshell. A subshell that is idle answers each message between its own
`busy` and `idle` status messages on IOPub, and Jupyter frontends and the
server keep a single execution state per kernel, the last one published; so
every message the frontend sent to the button (a click, or the widget
manager's state requests) turned the kernel `idle` in the middle of a running
cell. Here nothing runs on another shell and only the main shell publishes
status, so the kernel reads `busy` from the start to the end of the cell.

This relies on an ipykernel internal (the comm routing hook of 7.4);
pyproject pins the range and tests/test_panel.py checks the route end to end.
Where the hook is missing, `route_clicks` returns False and the panel says to
use the kernel's interrupt instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def is_click(data: Any) -> bool:
    """True for the data of the comm message a browser sends when a Button is clicked."""
    return (
        isinstance(data, dict)
        and data.get("method") == "custom"
        and isinstance(data.get("content"), dict)
        and data["content"].get("event") == "click"
    )


def route_clicks(widget: Any, on_click: Callable[[], None]) -> bool:
    """Call `on_click` (on the kernel's shell-channel thread) as soon as `widget` is clicked; False if impossible.

    `on_click` must be quick and thread-safe (setting an Event is the intended use).
    """
    comm = getattr(widget, "comm", None)
    original = getattr(comm, "_reply_subshell_for", None)
    if comm is None or not callable(original):
        return False

    def route(data: Any, default: str | None) -> str | None:
        if is_click(data):
            try:
                on_click()
            except Exception:  # noqa: BLE001, S110 - never break the kernel's shell-channel thread
                pass
        return original(data, default)  # type: ignore[no-any-return]

    # An instance attribute: only this widget's comm is affected.
    comm._reply_subshell_for = route
    return True
