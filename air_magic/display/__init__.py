"""How a call shows its progress: a widget panel in Jupyter, plain lines elsewhere."""

from __future__ import annotations

from ..events import Listener
from ..job import JobSpec


def make_display(spec: JobSpec) -> Listener:
    """The plain-text display; the panel replaces it inside a Jupyter kernel."""
    from .text import TextDisplay

    return TextDisplay()
