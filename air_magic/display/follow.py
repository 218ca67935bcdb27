"""Draw a background call's panel again, in the cell that asks (`%distributed_show`, `DistributedCall.show()`).

A running call gets a new live panel whose ranks' lines are read from their logs in the run directory,
from the first byte: every line written so far, then each new one as the call's thread polls (so a
reloaded page or a new cell gets the whole live view back). Rank states, phases and the end come from the
call itself; its Cancel button cancels the call. An ended call prints its static record, rebuilt from
the run directory (display/record.py). Outside a widget kernel a running call prints what each rank wrote so
far. Not for the first panel of a call (widgets.py, built by the runner's listeners).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..job import RankState
from ..launch.files import command_logs
from ..launch.files.rank_files import LogTail
from ..launch.files.rundir import RunDir
from ..listeners import Listener
from ..resources import ResourceSampler
from . import display_mode, in_widget_kernel
from .charts import MetricsTail
from .record import record_bundle
from .tail import TailBuffer

if TYPE_CHECKING:
    from ..job import JobResult

#: A calls.handle.DistributedCall (not imported: calls/handle.py imports this module to draw a call).
DistributedCall = Any


class LogReader:
    """Follows every rank's log of a run directory from its first byte: a LogTail per rank.

    With `command_ranks` (a panel's tabs), in a command run's directory (launch/files/command_logs.py) rank R's tab
    follows the log of the rank R that the command's launcher started in the newest attempt that has one, and its
    unit's log (its node's whole output, the launcher's lines included) until there is one; when a new attempt's
    rank R starts, the tab says so and follows it. Without it (the command line, which names nodes), each unit's.
    """

    def __init__(self, run_dir: Any, world_size: int, command_ranks: bool = False) -> None:
        self.run_dir = run_dir
        self.tails = [LogTail(path, from_start=True) for path in RunDir(run_dir).logs(world_size)]
        self.command = command_ranks and command_logs.is_command_run(run_dir)
        self.attempts: dict[int, int] = {}  # rank -> the attempt whose rank log its tab follows

    @property
    def paths(self) -> list[Path]:
        """The log each rank's tab follows now."""
        return [tail.path for tail in self.tails]

    def read(self, final: bool = False) -> dict[int, str]:
        """rank -> text appended since the last read, at most a chunk a rank (ranks with nothing new left out);
        `final`: the logs are complete (an unfinished UTF-8 sequence at the end is decoded as a replacement)."""
        out: dict[int, str] = self._follow_ranks(final) if self.command else {}
        for rank, tail in enumerate(self.tails):
            text = tail.read(final)
            if text:
                out[rank] = out.get(rank, "") + text
        return out

    def _follow_ranks(self, final: bool) -> dict[int, str]:
        """Point each tab at its rank's log of the newest attempt where it changed; what the old log still had,
        and a line that says which attempt follows, per rank."""
        out: dict[int, str] = {}
        newest: dict[int, tuple[int, Path]] = {}  # rank -> the newest attempt with its log, and that log
        for attempt in command_logs.attempts(self.run_dir):
            newest.update((rank, (attempt, log)) for rank, log in command_logs.rank_logs(self.run_dir, attempt).items())
        for rank, (attempt, log) in newest.items():
            if rank >= len(self.tails) or self.attempts.get(rank) == attempt:
                continue
            before = self.attempts.get(rank)
            rest = "".join(self.tails[rank].read_all(final=True)) if before is not None else ""
            if before is not None:
                rest += f"air_magic: attempt {attempt} of the run: rank {rank} starts again\n"
            self.tails[rank] = LogTail(log, from_start=True)
            self.attempts[rank] = attempt
            if rest:
                out[rank] = rest
        return out


class Follow(Listener):
    """A panel drawn again for a running call, fed from the run directory; the call's thread drives it."""

    def __init__(self, call: DistributedCall, panel: Listener) -> None:
        self.call = call
        self.panel = panel
        self.logs = LogReader(call.run_dir, call.spec.world_size, command_ranks=True)
        self.ended = False
        self.lock = threading.Lock()

    def attach(self) -> None:
        """Draw the panel now (in the calling cell), with what the call did so far, then follow the call."""
        ctx = self.call.ctx
        assert ctx is not None
        self.panel.on_start(ctx)
        for phase, _ in ctx.phases:
            self.panel.on_phase(phase)
        for rank, state in sorted(self.call.watch.states.items()):
            self.panel.on_rank_state(rank, state)
        self.feed()
        watch = self.call.watch
        with watch.lock:
            watch.followers.append(self)
            result = self.call.result_
        if result is not None:  # it ended while the panel was drawn
            self.on_end(result)

    def feed(self) -> None:
        for rank, text in self.logs.read().items():
            self.panel.on_output(rank, text)

    def on_phase(self, phase: Any) -> None:
        self.panel.on_phase(phase)

    def on_rank_state(self, rank: int, state: RankState) -> None:
        self.panel.on_rank_state(rank, state)

    def poll(self) -> None:
        with self.lock:
            if not self.ended:
                self.feed()
                self.panel.poll()

    def on_end(self, result: JobResult) -> None:
        with self.lock:
            if self.ended:
                return
            self.ended = True
            self.feed()
            self.panel.on_end(result)


def _sampler(call: DistributedCall) -> ResourceSampler | None:
    return next((x for x in call.listeners or () if isinstance(x, ResourceSampler)), None)


def record_of(call: DistributedCall) -> dict[str, str]:
    """The static record of an ended call, rebuilt from its run directory."""
    result = call.job()
    n = result.spec.world_size
    tails = [TailBuffer() for _ in range(n)]
    reader = LogReader(result.run_dir, n, command_ranks=True)
    while texts := reader.read(final=True):  # a chunk at a time: a long log is not held whole
        for rank, text in texts.items():
            tails[rank].feed(text)
    metrics = MetricsTail(result.run_dir, n)
    metrics.poll()
    sampler = _sampler(call)
    return record_bundle(result, tails, reader.paths, call.link, metrics, peaks=sampler.peaks() if sampler else None)


def show(call: DistributedCall) -> None:
    """Draw `call` here: its record if it ended, a live panel (or the lines so far) if it runs."""
    from IPython.display import display

    if call.done():
        display(record_of(call), raw=True)
        return
    call.has_run_dir()  # a running call has its run directory a moment after its listeners start
    if call.done():
        display(record_of(call), raw=True)
        return
    if call.ctx is None:
        print(f"air_magic: call {call.short} ({call.spec.name}) is {call.status}: it waits for {call.waiting_for}.")
        return
    mode = display_mode()
    if mode == "panel" or (mode == "auto" and in_widget_kernel()):
        from .starting import StartingLine
        from .widgets import Panel

        Follow(call, Panel(StartingLine(call.spec), resources=_sampler(call))).attach()
        return
    for rank, text in LogReader(call.run_dir, call.spec.world_size, command_ranks=True).read().items():
        print("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()), end="")
    print(f"air_magic: call {call.short} ({call.spec.name}) is {call.status}; logs in {call.run_dir}")
