"""Deliver a Cancel click while the kernel's main thread is busy running the cell, without a second shell.

A cell that calls the runner blocks the kernel's main thread until the job
ends, and ipykernel handles widget messages on that thread, so a click would
wait until the job is over. ipykernel 7 reads the shell channel in a thread
of its own and, for each comm message, asks the comm which (sub)shell should
handle it (`comm._reply_subshell_for(data, default)`), passing the message's
data. That question is asked at once, whatever the main thread is doing: so
the hook itself recognizes a click (`{"method": "custom", "content":
{"event": "click"}}`) and calls `on_click` there.

Every message to the panel's widgets is then handled by the main shell, once
the cell is done: JupyterLab sends widget messages over a subshell of its own
(see busy.py), whose thread would otherwise change the panel's widgets while
the cell's thread draws them, and would publish `idle` for each message. A
subshell of air_magic's own for the button would only add a thread and more
`idle` statuses.

This relies on an ipykernel internal (the comm routing hook of 7.4);
pyproject pins the range and tests/test_panel.py checks the route end to end.
Where the hook is missing, `keep_on_main_shell` returns False and the panel
says to use the kernel's interrupt instead.
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


def keep_on_main_shell(widget: Any, on_click: Callable[[], None] | None = None) -> bool:
    """Have the main shell handle every message the page sends to `widget`; False if impossible.

    With `on_click`, call it on the kernel's shell-channel thread as soon as `widget` is clicked,
    while the cell is still running. It must be quick and thread-safe (setting an Event is the intended use).
    """
    comm = getattr(widget, "comm", None)
    if comm is None or not callable(getattr(comm, "_reply_subshell_for", None)):
        return False

    def route(data: Any, default: str | None) -> str | None:
        if on_click is not None and is_click(data):
            try:
                on_click()
            except Exception:  # noqa: BLE001, S110 - never break the kernel's shell-channel thread
                pass
        return None  # the main shell

    # An instance attribute: only this widget's comm is affected.
    comm._reply_subshell_for = route
    return True
