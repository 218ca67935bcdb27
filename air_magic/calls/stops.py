"""How a call is stopped: the stop itself, a failure's stop after the peers' grace, the timeout, a Stop asked from
outside, and NCCL's flight recorder read before a GPU call's ranks are stopped.

`CallStops` is the runner's base class (runner.py), as `AttemptOutcome` (outcome.py), its own base, is: it acts on
the call's state that the runner keeps and declares here. Not for deciding what the call returns or raises
(outcome.py) nor for stopping processes (the launcher's `JobHandle.stop`, launch/stopper.py).
"""

from __future__ import annotations

import time

from .. import stopping
from ..job import StopReason
from ..launch.files import flight_recorder
from ..launch.interface import JobHandle
from ..launch.stopper import STOP_GRACE
from ..listeners import RunContext
from .outcome import AttemptOutcome

#: Seconds a session's other ranks may go on after one raised, before they get KeyboardInterrupt.
SESSION_PEERS_WAIT = 3.0
#: Seconds a GPU call waits for its ranks' flight recorder dumps before it stops them (NCCL's monitor thread
#: looks at the pipe that asks for one about once a second; the dump took 7 s on an H200 with torch 2.11).
RECORDER_WAIT = 10.0
#: Seconds between two looks for a Stop asked from outside the runner (the flag's file in the run directory).
_STOP_LOOK = 0.2
#: Stops before which a GPU call's ranks dump their flight recorder (Ctrl-C is not kept waiting).
_RECORDED_STOPS = (StopReason.TIMEOUT, StopReason.CANCELLED, StopReason.RANK_FAILED)


class CallStops(AttemptOutcome):
    """The stopping half of a call: when and how its ranks are stopped."""

    ctx: RunContext
    handle: JobHandle | None
    stop_due: float | None
    stop_forwarded: bool
    stop_looked_at: float
    recorder_asked: tuple[float, set[int], float] | None
    paused: float
    gone: bool

    def stop(self, reason: StopReason) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            if self.handle is not None and self.spec.uses_gpu and reason in _RECORDED_STOPS:
                self.dump_recorder(wait=True)  # where each rank's collectives were, before they are stopped
            if self.handle is not None:
                self.handle.stop(reason.value, STOP_GRACE, self.interrupt_after(reason))

    def stop_after_failure(self) -> None:
        """A rank failed: stop the others now, or, while only collectives failed, after `stop_grace` (in `wait`)."""
        grace = self.stop_grace()
        if not grace:
            self.stop(StopReason.RANK_FAILED)
        elif self.stop_due is None:
            self.stop_due = time.monotonic() + grace

    def interrupt_after(self, reason: StopReason) -> float | None:
        """A session's ranks are asked to come back (KeyboardInterrupt) before they are stopped: after how long."""
        if self.spec.session is None or reason == StopReason.LAUNCH_FAILED:
            return None
        return SESSION_PEERS_WAIT if reason == StopReason.RANK_FAILED else 0.0

    def past_deadline(self) -> bool:
        """The call's timeout (one for every attempt, from the call's start) is over, time at a prompt aside."""
        timeout = self.spec.timeout
        return timeout is not None and time.monotonic() > self.ctx.started_at + timeout + self.paused

    def dump_recorder(self, wait: bool) -> None:
        """Ask each GPU rank for a dump of NCCL's flight recorder; `wait`: until they come (RECORDER_WAIT at most),
        else `read_recorder` reads them as they come."""
        since = time.time()
        asked = flight_recorder.ask_for_dumps(self.run_dir.path)
        if not asked:
            return
        self.recorder_asked = (since, asked, time.monotonic() + RECORDER_WAIT)
        if wait:
            flight_recorder.wait_for_dumps(self.run_dir.path, asked, since, RECORDER_WAIT)
            self.read_recorder(force=True)

    def read_recorder(self, force: bool = False) -> None:
        """Once every rank asked has dumped its recorder (or the wait is over): what they say, for the listeners."""
        if self.recorder_asked is None:
            return
        since, asked, give_up_at = self.recorder_asked
        waiting = not force and time.monotonic() < give_up_at
        if waiting and not asked <= set(flight_recorder.dumps_since(self.run_dir.path, since)):
            return
        self.recorder_asked = None
        dumps = flight_recorder.read_dumps(self.run_dir.path)
        self.ctx.collectives = flight_recorder.collectives_summary(dumps, self.spec.world_size) if dumps else None

    def forward_stop(self) -> None:
        """A Stop asked for this call (its flag in the run directory) goes on to ranks that read another directory."""
        now = time.monotonic()
        if self.stop_forwarded or self.handle is None or now - self.stop_looked_at < _STOP_LOOK:
            return
        self.stop_looked_at = now
        if stopping.stop_requested(self.run_dir.path):
            self.stop_forwarded = True
            self.ctx.stop_requested = True
            self.handle.request_stop()
