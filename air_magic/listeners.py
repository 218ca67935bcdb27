"""The listener interface: what the runner tells the display and the tracking of a call.

It sits below both sides: calls/ (the runner) speaks it, and the listeners (display/, tracking/, watching/, the
resource sampler) implement it without importing calls/; the owner (air_magic/owner/) plugs them in.
The runner owns the call; listeners only hear about it. Each hook is called
from the thread that made the call, so a listener needs no locking of its own
unless it starts threads itself.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .job import Alert, JobResult, JobSpec, RankState
from .phase import Phase


@dataclass
class RunContext:
    """What a listener may know about a call in progress, and what it may ask: a cancel, or the ranks' stacks."""

    spec: JobSpec
    run_dir: Path
    log_paths: list[Path]
    links: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    #: (phase, seconds since the call started) in the order the call's start went through them (see Phase).
    phases: list[tuple[Phase, float]] = field(default_factory=list)
    #: rank -> pid of its process as the launcher reported it (a process of this machine unless num_nodes > 1).
    pids: dict[int, int] = field(default_factory=dict)
    #: The attempt running now, from 0; more than 0 after a restart (see `Listener.on_attempt`).
    attempt: int = 0
    #: How each earlier attempt ended (its first failure), one line each, oldest first.
    earlier_failures: list[str] = field(default_factory=list)
    #: What NCCL's flight recorder says of the ranks' collectives, once their dumps are read (GPU calls):
    #: "rank 3 waits in all_reduce #1204; ranks 5 and 6 never reached it".
    collectives: str | None = None
    #: A Stop was asked for (the ranks' `should_stop()` says so from their next look).
    stop_requested: bool = False
    #: What the watch of the call saw so far (watching/), oldest first.
    alerts: list[Alert] = field(default_factory=list)
    #: rank -> its recent steps on average, in seconds: "input", "compute", "collective", "step"; and "steps" done.
    step_times: dict[int, dict[str, float]] = field(default_factory=dict)
    _hang: Alert | None = None
    _cancel: threading.Event = field(default_factory=threading.Event)
    _stacks: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Ask the runner to stop every rank; safe to call from any thread."""
        self._cancel.set()

    def ask_stacks(self) -> None:
        """Ask the runner to have every rank write its stacks to its log, stopping nothing; safe from any thread."""
        self._stacks.set()

    def act_on_hang(self, alert: Alert) -> None:
        """Ask the runner to act on a hang as the call's `on_hang` says ("stop", "restart"); safe from any thread."""
        self._hang = alert

    def take_hang(self) -> Alert | None:
        """The hang to act on, once (the runner's side)."""
        hang, self._hang = self._hang, None
        return hang

    def take_stacks_request(self) -> bool:
        """True once after each `ask_stacks` (the runner's side)."""
        asked = self._stacks.is_set()
        self._stacks.clear()
        return asked

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started_at

    @property
    def attempts_allowed(self) -> int:
        """Attempts the call may take: 1 plus its `max_restarts`."""
        return 1 + self.spec.max_restarts

    @property
    def phase(self) -> Phase | None:
        """The phase the call's start is in now (None before the first)."""
        return self.phases[-1][0] if self.phases else None


class Listener:
    """No-op base: override the hooks you need."""

    def on_start(self, ctx: RunContext) -> None:
        """The run directory exists; workers are about to start."""

    #: What this listener's on_start does, as a phase of the call (None: too quick to mention).
    start_phase: Phase | None = None

    def on_phase(self, phase: Phase) -> None:
        """The call's start entered `phase` (also appended to `ctx.phases`); may come before on_start."""

    def worker_env(self) -> dict[str, str]:
        """Environment variables every worker should get (called after on_start)."""
        return {}

    def worker_hooks(self) -> list[str]:
        """Modules every rank imports before the call (their `install()` runs then, `flush()` after it)."""
        return []

    def on_output(self, rank: int, text: str) -> None:
        """New text from a rank's log (stdout and stderr, in order)."""

    def on_rank_state(self, rank: int, state: RankState) -> None:
        """A rank changed state."""

    def on_attempt(self, attempt: int, why: str) -> None:
        """Every process of the last attempt is gone and the whole world starts again, as attempt `attempt`
        (from 0; `ctx.attempts_allowed` in all); `why`: how the last one ended, one line. The ranks' states
        are back to pending, and their logs go on in the same files after a marker line."""

    def poll(self) -> None:
        """Called about every 50 ms while the call runs (refresh clocks, handle clicks)."""

    def on_end(self, result: JobResult) -> None:
        """The call is over: every rank has ended (after a success, the local launcher's may still be exiting;
        the next call waits for them). `result.status` says how it ended."""
