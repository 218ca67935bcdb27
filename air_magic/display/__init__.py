"""How a call shows its progress: a widget panel in Jupyter, plain lines elsewhere.

`AIR_MAGIC_DISPLAY` chooses: `auto` (default: the panel inside a Jupyter
kernel that has ipywidgets, plain lines elsewhere), `panel`, or `text`
(plain lines everywhere). Either way a notebook keeps what happened: the
panel turns into a static record (HTML and plain text) when the call ends,
so notebooks executed headless by nbclient or papermill keep it too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING

from ..envvars import DISPLAY
from ..errors import ConfigurationError
from ..job import JobSpec
from ..listeners import Listener

if TYPE_CHECKING:
    from ..resources import ResourceSampler

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
    mode = os.environ.get(DISPLAY, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ConfigurationError(f"{DISPLAY}={mode!r} is not a display mode; use one of {', '.join(_MODES)}.")
    return mode


def make_display(spec: JobSpec, resources: ResourceSampler | None = None) -> Listener:
    """The panel inside a Jupyter kernel that can show widgets, the plain-text display otherwise.

    With `resources`, the panel shows what each rank uses and the record keeps each rank's peak.
    """
    mode = display_mode()
    if mode == "panel" or (mode == "auto" and in_widget_kernel()):
        from . import busy

        busy.hold()  # the kernel reads busy until the call ends (see busy.py)
        from .starting import StartingLine

        starting = StartingLine(spec)  # on screen at once: importing ipywidgets takes a while the first time
        from .widgets import Panel

        return Panel(starting, resources=resources)
    from .text import TextDisplay

    return TextDisplay()
