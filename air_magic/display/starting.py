"""The first thing a call shows: a plain "starting" line, and the words for what the call is waiting for.

Shown before ipywidgets is imported (that import takes a while on a first call); the panel then
takes its place. Not for the panel itself (widgets.py) or the final record (record.py).
"""

from __future__ import annotations

import html
import sys

from ..job import JobSpec
from ..phase import Phase


def waiting_for(spec: JobSpec, phase: Phase | None = None, run_made: bool = False) -> str:
    """What a call that has not started its ranks yet waits for, as the panel's phase says it.

    `phase`: the runner's phase of the call's start (see `Listener.on_phase`); once the listeners have
    started, a phase other than RANKS_STARTING is the launcher's own (say, starting a helper).
    """
    waits: list[str] = []
    if spec.mlflow and not run_made and phase in (None, Phase.CREATING_RUN):
        waits.append(Phase.CREATING_RUN)
    if phase is not None and phase not in (Phase.CREATING_RUN, Phase.RANKS_STARTING, Phase.RUNNING):
        waits.append(phase)
    waits.append(f"{spec.world_size} rank(s)" if not waits else f"starting {spec.world_size} rank(s)")
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
            {
                "text/html": f'<div class="air-magic-starting" style="white-space:nowrap">{html.escape(text)}</div>',
                "text/plain": f"air_magic: {text}",
            },
            raw=True,
            display_id=True,
        )
        shell = sys.modules["IPython"].get_ipython()
        if shell is not None:
            shell.events.register("post_run_cell", self._after_cell)

    def _after_cell(self, result: object = None) -> None:
        sys.modules["IPython"].get_ipython().events.unregister("post_run_cell", self._after_cell)
        if not self.taken:
            self.handle.update({"text/plain": ""}, raw=True)
