"""Deliver a widget's clicks while the kernel's main thread is busy running the cell.

A cell that calls the runner blocks the kernel's main thread until the job
ends, and ipykernel handles widget messages on that thread, so a Cancel
click would wait until the job is over. ipykernel 7 reads the shell channel
in its own thread and asks each comm where its messages should go
(`_reply_subshell_for`); a kernel subshell is a second thread with its own
event loop that handles what is sent to it. So: create one subshell per
kernel, and make the Cancel button's comm send its messages there. The click
handler then runs in the subshell thread while the cell is still executing.

This relies on ipykernel internals (the subshell manager and the comm
routing hook of 7.4); pyproject pins the range and tests/test_panel.py checks
the route end to end. Where the hooks are missing, `route_to_background`
returns False and the panel says to use the kernel's interrupt instead.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_subshell_id: str | None = None


def _kernel() -> Any:
    try:
        from ipykernel.kernelbase import Kernel
    except ImportError:
        return None
    return Kernel.instance() if Kernel.initialized() else None


def background_subshell(timeout: float = 5.0) -> str | None:
    """The id of this kernel's air_magic subshell, created on first use; None if the kernel has none."""
    global _subshell_id
    kernel = _kernel()
    channel = getattr(kernel, "shell_channel_thread", None)
    manager = getattr(channel, "_manager", None)
    if channel is None or manager is None or not hasattr(manager, "_create_subshell"):
        return None
    with _lock:
        if _subshell_id is not None and _subshell_id in manager.list_subshell():
            return _subshell_id
        done = threading.Event()
        made: list[str] = []

        def create() -> None:  # the manager may only be changed from the shell-channel thread
            try:
                made.append(manager._create_subshell())
            finally:
                done.set()

        channel.io_loop.add_callback(create)
        if not done.wait(timeout) or not made:
            return None
        _subshell_id = made[0]
        return _subshell_id


def route_to_background(widget: Any) -> bool:
    """Send every message the frontend sends to `widget` to the background subshell; False if impossible."""
    comm = getattr(widget, "comm", None)
    if comm is None or not callable(getattr(comm, "_reply_subshell_for", None)):
        return False
    subshell = background_subshell()
    if subshell is None:
        return False

    def route(data: Any, default: str | None) -> str:
        return subshell

    # An instance attribute, so the comm's own bookkeeping (which re-points replies at
    # whichever thread last published on it) cannot send clicks back to the busy thread.
    comm._reply_subshell_for = route
    return True
