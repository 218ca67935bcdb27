"""How a call of a session ends on Ray: its ranks asked to come back before they are stopped, and whether the
session's world stays.

The pump (pump.py) holds one `SessionCall` per job and tells it what happens;
this module talks to no actor (the pump passes how to interrupt a rank). The
local supervisor does the same in supervisor.py::interrupt_session, with the
same `Interrupt` and `COME_BACK`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..come_back import Interrupt
from ..keeper import stopped as keeper_stopped
from ..keeper import unusable as unusable_rank


class SessionCall:
    """What decides the end of one job's session (`name` None: the job holds none, and nothing of this applies)."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        #: Ranks whose failed call left them usable (RankFiles.session_kept).
        self.kept: set[int] = set()
        #: The ranks were asked to come back (a stop with `interrupt_after`).
        self.interrupt: Interrupt | None = None
        #: Why the session's world ends with this job (said in SessionEnded); None: it stays, or there is none.
        self.end: str | None = None

    def ask_back(self, reason: str, after: float) -> bool:
        """A stop with `interrupt_after`: True when the ranks are to be interrupted (a session's job) instead."""
        if self.name is None:
            return False
        if self.interrupt is None:  # a second one changes nothing; a stop without it stops at once
            self.interrupt = Interrupt(time.monotonic() + after, reason)
        return True

    def interrupting(self, running: list[int], interrupt: Callable[[int], None]) -> str | None:
        """One step of the interrupt asked for: KeyboardInterrupt in each running rank once it is time (a rank still
        loading the call keeps it for its code); when some have not come back in time (`Interrupt.late`), the session
        ends and the stop's reason is returned. `in_code` says which ranks took theirs in their code."""
        asked = self.interrupt
        if asked is None or not running:
            return None
        now = time.monotonic()
        for rank in asked.send_to(running, now, in_code=False):
            interrupt(rank)
        late = asked.late(running, now)
        if late:
            self.ends(asked.not_back(late))
            return asked.why
        return None

    def in_code(self, rank: int) -> None:
        """`rank` said its interrupt was raised in its user code: it has `Interrupt.wait` s to come back."""
        if self.interrupt is not None:
            self.interrupt.in_code.add(rank)

    def ends(self, why: str) -> None:
        """The session's world ends with this job; the first reason given is the one said."""
        if self.name is not None:
            self.end = self.end or why

    def usable(self, codes: dict[int, int]) -> bool:
        """Every rank that exited is usable for the next call: it succeeded, or failed in the session's user code."""
        return all(code == 0 or (self.name is not None and rank in self.kept) for rank, code in codes.items())

    def ended(self, codes: dict[int, int], stopped: str | None, failure: str) -> None:
        """The world was not kept: why, if no reason was given yet (`stopped`: the stop's reason, if stopped)."""
        unusable = [rank for rank, code in sorted(codes.items()) if code != 0 and rank not in self.kept]
        if stopped is not None:
            self.ends(keeper_stopped(stopped or "stopped"))
        elif unusable:
            self.ends(unusable_rank(unusable[0]))
        else:
            self.ends(failure or "its call did not finish on every rank")
