"""The listeners the owner plugs into each call: the resource sampler, the watch, the profiler and the GPU memory
report, MLflow tracking and the display (the call's live record is its handle's own, calls/record.py). The one place
that names them; calls/ only speaks their interface (air_magic/listeners.py). Not for: what a listener does
(display/, tracking/, watching/, profiling/, resources.py).
"""

from __future__ import annotations

from typing import Any

from ..display import make_display
from ..job import JobSpec
from ..listeners import Listener
from ..profiling.listener import Profiler
from ..profiling.memory import MemoryReport
from ..resources import ResourceSampler
from ..tracking.listener import MlflowTracker, make_tracker
from ..watching.fatal_lines import FatalLines
from ..watching.listener import Watcher


def default_listeners(spec: JobSpec) -> list[Listener]:
    """The resource sampler, tracking (it makes the run link), then the display that shows both.

    The sampler comes first so that it has logged its last sample to the run before the tracker ends it.
    """
    sampler = ResourceSampler()
    listeners: list[Listener] = [sampler]
    if spec.mlflow:
        tracker = make_tracker(spec)
        if tracker is not None:
            listeners.append(tracker)
            if isinstance(tracker, MlflowTracker):
                sampler.sinks.append(tracker.log_system_metrics)
    if spec.watch:
        watcher = Watcher(spec)
        listeners.insert(1, watcher)  # before tracking and the display, which show what it found
        watcher.sinks += sampler.sinks  # the MLflow run's, as the sampler's
    listeners.insert(1, FatalLines())  # before tracking and the display, which show its alerts
    if spec.profile:
        listeners.insert(1, Profiler(spec))  # before tracking and the display, which show what it found
    if spec.uses_gpu:
        listeners.insert(1, MemoryReport(spec))  # each rank's peak CUDA memory, for the record
    listeners.append(make_display(spec, sampler))
    return listeners  # the call's record on disk is the handle's own (calls/record.py LiveRecord, put last)


def captured(listeners: list[Listener], *args: Any) -> list[Listener]:
    """`listeners`, each told now which MLflow run and experiment are active on this thread (`capture`): a call
    that runs on another thread or in another process makes its run there (a child of the active one)."""
    for listener in listeners:
        capture = getattr(listener, "capture", None)
        if callable(capture):
            capture(*args)
    return listeners
