"""Keep the kernel reading `busy` from the start to the end of a call, whatever else it answers meanwhile.

Why it reads `idle` otherwise (ipykernel 7.4, JupyterLab 4.6): JupyterLab sends
widget messages over a kernel subshell of its own ("comms over subshells",
one per comm target). On the first widget of a kernel it asks for that
subshell with a `create_subshell_request` on the control channel; later,
every message the page sends to a widget (a click, a tab change) is handled
on that subshell's thread. ipykernel answers each of these between its own
`busy` and `idle` status messages on IOPub, from the control or subshell
thread, while the main shell is still running the cell. JupyterLab and the
Jupyter server keep one execution state per kernel, the last one published,
so the kernel reads `idle` for the rest of the call; that is why the first
call of a kernel looked finished, and a later one after any click.

What this does: while a call runs, an `idle` published by any thread other
than the main one is followed at once by a `busy` whose parent is the cell's
own request. Clients still get the `idle` that ends their request (JupyterLab
waits for it before it uses the subshell), and the kernel's state is `busy`
again a moment later, until the cell's own `idle`. A lock orders this against
the end of the call, so no `busy` can follow the cell's final `idle`.

Uses an ipykernel internal (`Kernel._publish_status`, 7.4); pyproject pins the
range and tests/test_browser.py samples the server's state through a call.
Outside an ipykernel kernel it does nothing.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_parent: dict[str, Any] | None = None  # the cell's request while a call runs, else None


def _kernel() -> Any:
    try:
        from ipykernel.kernelbase import Kernel
    except ImportError:
        return None
    return Kernel.instance() if Kernel.initialized() else None


def _install(kernel: Any) -> bool:
    if getattr(kernel, "_air_magic_busy_kept", False):
        return True
    original = getattr(kernel, "_publish_status", None)
    if not callable(original):
        return False
    main = threading.main_thread()

    def publish_status(status: str, channel: str, parent: Any = None) -> Any:
        if status != "idle" or threading.current_thread() is main:
            return original(status, channel, parent)
        with _lock:
            out = original(status, channel, parent)
            if _parent is not None:
                original("busy", "shell", _parent)
            return out

    kernel._publish_status = publish_status
    kernel._air_magic_busy_kept = True
    return True


def hold() -> bool:
    """From the thread running the cell, at the start of a call: keep the kernel `busy` until `release()`."""
    global _parent
    kernel = _kernel()
    if kernel is None or threading.current_thread() is not threading.main_thread():
        return False
    parent = kernel.get_parent("shell")
    if not parent or not parent.get("header"):
        return False
    with _lock:
        if not _install(kernel):
            return False
        _parent = parent
    _release_after_cell()
    return True


def _release_after_cell() -> None:
    """Whatever happens to the call, the hold ends with the cell (IPython's post_run_cell comes before its idle)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    events = getattr(shell, "events", None)
    if events is not None and _after_cell not in events.callbacks.get("post_run_cell", []):
        events.register("post_run_cell", _after_cell)


def _after_cell(result: Any = None) -> None:
    release()


def release() -> None:
    """At the end of a call (before the cell's own `idle`); a background call's end (another thread) leaves the
    hold of the cell running now alone."""
    global _parent
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        _parent = None
