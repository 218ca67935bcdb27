"""`Phase`: where a call's start is, one type shared by the runner, the launchers, the listeners and the display.

The runner records each phase it enters, with its time, in `RunContext.phases` and tells the listeners
(`Listener.on_phase`); a listener's `start_phase` and a launcher's `prepare()` name the phase they take
(an attempt after a restart goes through them again).
The value is the words the display shows. Not for how a call ended (`JobStatus`) or a rank's state (`RankState`).
"""

from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    """A step of a call's start, in the order the runner enters them (a step may be skipped)."""

    #: MLflow tracking makes the call's run (its listener's `start_phase`).
    CREATING_RUN = "creating the MLflow run"
    #: The local launcher starts its helper (it imports torch) because none is running (its `prepare()`).
    STARTING_HELPER = "starting the helper"
    #: The launcher was asked to start the ranks.
    RANKS_STARTING = "ranks starting"
    #: A rank runs the call.
    RUNNING = "running"
