"""The Launcher interface: the one seam between the runner and wherever ranks run.

The runner holds a `Launcher` and nothing below it. A launcher starts the
ranks of a `JobRequest`, reports what they do as events (protocol.py), stops
them on request, and says when every process of the job is gone. The local
supervisor (local/) is one implementation; one whose ranks run on other
machines plugs in the same way and feeds the same listeners.
"""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod

from ..phase import Phase
from .files.rundir import RunDir
from .protocol import Event, JobRequest

#: Why a session ended when its user ended it (`%distributed_session --end`).
ENDED_BY_USER = "%distributed_session --end ended it"


def drain(events: queue.Queue[Event], timeout: float) -> list[Event]:
    """Everything in `events`, waiting up to `timeout` s for the first: how a JobHandle answers next_events."""
    out: list[Event] = []
    try:
        out.append(events.get(timeout=timeout))
        while True:
            out.append(events.get_nowait())
    except queue.Empty:
        pass
    return out


class JobHandle(ABC):
    """One started job, as its launcher reports it."""

    #: True: once every rank has exited with success the runner may end the call before `JobGone`;
    #: after `close()` the launcher lets the job's processes finish exiting, and its next job waits for that.
    ends_in_background: bool = False

    @abstractmethod
    def next_events(self, timeout: float) -> list[Event]:
        """Events since the last call, waiting up to `timeout` s for the first; [] if none came.

        A rank's output comes before its `RankExited`; `JobGone` is the last event of the job.
        """

    @abstractmethod
    def stop(self, reason: str, grace: float, interrupt_after: float | None = None) -> None:
        """End every process of the job: SIGTERM (or the launcher's equivalent), then kill after `grace` s.

        `interrupt_after` (a session's call, on a launcher that supports "session"): after that many seconds
        raise KeyboardInterrupt in each rank still running and keep the session if they all come back; stop
        them only if they do not. A later stop without it stops at once.
        """

    def close(self) -> None:
        """The runner is done with this handle (after `JobGone`, or giving up on it)."""

    def dump_stacks(self) -> None:
        """Have every rank write its threads' stacks to its log now (they arrive as `RankOutput`); nothing stops.

        A launcher whose ranks cannot do that does nothing.
        """

    def request_stop(self) -> None:
        """A Stop was asked (the flag in the call's run directory, stopping.py): carry it to ranks that read another
        directory. Ranks that read the call's own run directory need nothing: the default does nothing."""


class Launcher(ABC):
    """Starts jobs."""

    #: Call settings this launcher honours beyond the basics; the runner refuses a call that asks for
    #: one it lacks, before anything starts. "keep_alive": hot ranks kept between calls; "warm": ranks
    #: forked from a warm helper (`warm=`); "session": calls of a named session share hot ranks that keep a
    #: namespace and outlive a user error (JobRequest.session); "debug": a rank's `breakpoint()` is answered from
    #: the notebook through the run directory (launch/files/debug_channel.py).
    supports: frozenset[str] = frozenset()

    def prepare(self) -> Phase | None:
        """Get ready for a call while the listeners start (say, start a helper); the phase that takes, if any."""
        return None

    def prepare_hooks(self, hooks: list[str], env: dict[str, str]) -> None:
        """Ahead of a call: where ranks start from a warm helper, have it run the `preload(env)` of these hook
        modules (JobRequest.hooks) in the background, as a call naming them would. Returns at once; never starts a
        helper. A launcher without one does nothing."""

    def release_hot(self) -> None:
        """End every idle rank kept for the next call (a running call's ranks end with it); their memory is freed."""

    def end_session(self, name: str, why: str = ENDED_BY_USER) -> None:
        """End session `name`'s ranks now (a running call of it is stopped), saying `why`; nothing if it has none."""

    def held(self) -> list[str]:
        """A line for each set of ranks kept between calls other than a session's (hot ranks, spare actors): what it
        holds and for how long; [] if none."""
        return []

    def shutdown(self) -> None:
        """Stop whatever this launcher still runs (at exit, or when the extension is unloaded); it may be used again."""

    @abstractmethod
    def start(self, request: JobRequest, run_dir: RunDir) -> JobHandle:
        """Start every rank of `request`; `run_dir` is where its record (every rank's log) is kept here."""
