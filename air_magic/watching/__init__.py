"""Watching a call: the step times each rank keeps, stragglers and hangs named while the call runs, fatal lines.

detector.py  the rules (plain logic, no process or clock of its own)
listener.py  the runner listener that reads the ranks' files and raises the alerts
fatal_lines.py  the runtime's fatal output lines (out of memory, NCCL, CUDA, Xid, ...): a listener that raises an
             alert for each rank's first line of a kind, and the patterns the command line uses too

The rank's side is launch/rank/steps.py, the file between them launch/files/step_times.py; the rules and what
each alert looks like are in docs/watching.md.
"""

from __future__ import annotations

from ..errors import ConfigurationError
from ..job import ON_HANG


def check_watch(watch: object, on_hang: object, max_restarts: int) -> None:
    """The options of the watch, as both front doors take them: `watch` a bool; `on_hang` one of ON_HANG, and
    "restart" only with restarts allowed."""
    if not isinstance(watch, bool):
        raise ConfigurationError(f"watch must be True or False, got {watch!r}.")
    if on_hang not in ON_HANG:
        raise ConfigurationError(
            f"on_hang must be one of {', '.join(repr(o) for o in ON_HANG)}, got {on_hang!r}; "
            "'report' (the default) names a hung rank and lets the call go on."
        )
    if on_hang == "restart" and max_restarts < 1:
        raise ConfigurationError(
            "on_hang='restart' starts every rank again after a hang, within max_restarts, which is 0; "
            "pass max_restarts=1 (or more) too, or on_hang='stop'."
        )
