"""How a call shows its progress: a widget panel in Jupyter, plain lines elsewhere.

`AIR_MAGIC_DISPLAY` chooses: `auto` (default: the panel inside a Jupyter
kernel that has ipywidgets, plain lines elsewhere), `panel`, or `text`
(plain lines everywhere). Either way a notebook keeps what happened: the
panel turns into a static record (HTML and plain text) when the call ends,
so notebooks executed headless by nbclient or papermill keep it too.
"""

from __future__ import annotations

import html
import importlib.util
import os
import sys

from ..errors import ConfigurationError
from ..events import Listener
from ..job import JobSpec

_MODES = ("auto", "panel", "text")


def in_widget_kernel() -> bool:
    """True inside a Jupyter (ipykernel) kernel where ipywidgets can be imported."""
    ipython = sys.modules.get("IPython")  # a script that never imported IPython is not in a kernel
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False  # a terminal IPython has no kernel
    return importlib.util.find_spec("ipywidgets") is not None


def display_mode() -> str:
    """The chosen mode from $AIR_MAGIC_DISPLAY, checked."""
    mode = os.environ.get("AIR_MAGIC_DISPLAY", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ConfigurationError(
            f"AIR_MAGIC_DISPLAY={mode!r} is not a display mode; use one of {', '.join(_MODES)}."
        )
    return mode


def waiting_for(spec: JobSpec, run_made: bool = False) -> str:
    """What a call that has not started its ranks yet waits for, as the panel's phase says it."""
    from ..launch.local import local_launcher

    waits = []
    if spec.mlflow and not run_made:
        waits.append("creating the MLflow run")
    if local_launcher().supervisor_pid is None:
        waits.append("starting air_magic's helper process")
    waits.append(f"starting {spec.world_size} rank(s)")
    return "starting: " + ", ".join(waits)


class StartingLine:
    """A plain line shown the moment a call begins, before ipywidgets is imported; the panel takes its place.

    If the call never gets as far as the panel (its arguments cannot be serialized, say), the line is
    emptied when the cell ends, so no "starting" is left behind.
    """

    def __init__(self, spec: JobSpec) -> None:
        from IPython.display import display

        text = f"{spec.name} · {spec.world_size} rank(s) · {spec.accelerator_type} · {waiting_for(spec)}"
        self.taken = False
        self.handle = display(
            {"text/html": f'<div class="air-magic-starting" style="white-space:nowrap">{html.escape(text)}</div>',
             "text/plain": f"air_magic: {text}"},
            raw=True, display_id=True,
        )
        shell = sys.modules["IPython"].get_ipython()
        if shell is not None:
            shell.events.register("post_run_cell", self._after_cell)

    def _after_cell(self, result: object = None) -> None:
        sys.modules["IPython"].get_ipython().events.unregister("post_run_cell", self._after_cell)
        if not self.taken:
            self.handle.update({"text/plain": ""}, raw=True)


def make_display(spec: JobSpec) -> Listener:
    """The panel inside a Jupyter kernel that can show widgets, the plain-text display otherwise."""
    mode = display_mode()
    if mode == "panel" or (mode == "auto" and in_widget_kernel()):
        from . import busy

        busy.hold()  # the kernel reads busy until the call ends (see busy.py)
        starting = StartingLine(spec)  # on screen at once: importing ipywidgets takes a while the first time
        from .widgets import Panel

        return Panel(starting)
    from .text import TextDisplay

    return TextDisplay()
