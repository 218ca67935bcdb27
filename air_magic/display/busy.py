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

Following such an `idle` at once by a `busy` for the cell is not enough:
the Jupyter server reads IOPub one message per turn of its event loop, so a
`GET /api/kernels/<id>` answered between the two reads `idle` (1 reading in
about 40, sampled every 0.25 s through a first call, where JupyterLab's
`create_subshell_request` on the control channel publishes one).

What this does: while a call runs, an `idle` published by any thread other
than the main one goes out with its parent's `msg_type` read as
`kernel_info_request`, a request the Jupyter server and JupyterLab leave out
of the kernel's state (their `untracked_message_types`); its `msg_id` is the
request's own, so the client that sent it still sees its request end
(JupyterLab waits for that `idle` before it uses the subshell). A `busy` whose
parent is the cell's own request follows it, for clients that count every
status. The hold ends with the cell (IPython's `post_execute`, before the
cell's own `idle`), not with the panel: the cell's code after the call, and
JupyterLab's `delete_subshell_request` once the panel's widgets close, come
before that `idle` too. A lock orders this against the end of the hold, so no
`busy` can follow the cell's final `idle`.

Uses an ipykernel internal (`Kernel._publish_status`, 7.4); pyproject pins the
range and tests/test_browser.py samples the server's state through a call.
Outside an ipykernel kernel it does nothing.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_parent: dict[str, Any] | None = None  # the cell's request while a call runs, else None
#: A request type in the default `untracked_message_types` of jupyter_server and JupyterLab.
UNCOUNTED = "kernel_info_request"


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
            if _parent is None:
                return original(status, channel, parent)
            out = original(status, channel, _uncounted(parent or kernel.get_parent(channel)))
            original("busy", "shell", _parent)
            return out

    kernel._publish_status = publish_status
    kernel._air_magic_busy_kept = True
    return True


def _uncounted(parent: Any) -> Any:
    """`parent` with its msg_type one the Jupyter server does not count in the kernel's state; its msg_id kept."""
    if not isinstance(parent, dict) or not isinstance(parent.get("header"), dict):
        return parent
    return {**parent, "header": {**parent["header"], "msg_type": UNCOUNTED}}


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
    """Whatever happens to the call, the hold ends with the cell (IPython's post_execute comes before its idle)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    events = getattr(shell, "events", None)
    if events is not None and _after_cell not in events.callbacks.get("post_execute", []):
        events.register("post_execute", _after_cell)


def _after_cell(result: Any = None) -> None:
    _end()


def release() -> None:
    """At the end of a call. Inside a cell the hold lasts until the cell ends (`post_execute`); a background call's
    end (another thread) leaves the hold of the cell running now alone."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        held = _parent
    if held is not None and held.get("header", {}).get("msg_type") == "execute_request" and _in_cell():
        return
    _end()


def _in_cell() -> bool:
    """True while the kernel's main thread runs a cell that will end with IPython's post_execute."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    events = getattr(shell, "events", None)
    return events is not None and _after_cell in events.callbacks.get("post_execute", [])


def _end() -> None:
    global _parent
    with _lock:
        _parent = None
