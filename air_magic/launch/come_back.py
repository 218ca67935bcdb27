"""How a session's call is asked to come back before its ranks are stopped, for every launcher.

A session's ranks that are still running when their call must end (a rank raised, Ctrl-C, Cancel, the
timeout) get a KeyboardInterrupt once `Interrupt.at` is reached, each as soon as its user code can take one, and
those that do not return in time are stopped and the session ends. A rank interrupted in its user code has
`COME_BACK` seconds, stretched a little by this machine's load (load.py). A rank not known to be there yet (still
loading the call, or not scheduled) keeps the interrupt for when its code starts and has until
`at + LONGEST_COME_BACK`. The local supervisor (local/supervisor.py) and the Ray pump (ray/ending.py) keep one
`Interrupt` per call and act on it; this module holds the timing and the sentence.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .load import MOST_PATIENCE, patience

#: Seconds a session's rank interrupted in its user code has to come back from KeyboardInterrupt before it is
#: stopped (and the session ends), on an idle machine.
COME_BACK = 5.0
#: The most that is stretched by the load: Python takes a KeyboardInterrupt at its next line, so a rank that does
#: not come back in twice the time is stuck in a collective or in C, and waiting longer only delays the end.
RUNNING_PATIENCE = 2.0
#: The most a rank is given, counted from `Interrupt.at`, when it was not yet in its user code (loading the call on
#: the busiest machine): what a caller waiting for the call's end allows for it.
LONGEST_COME_BACK = COME_BACK * MOST_PATIENCE


def _come_back() -> float:
    return COME_BACK * min(patience(), RUNNING_PATIENCE)


@dataclass
class Interrupt:
    """A session call asked to come back: KeyboardInterrupt to its running ranks from `at` (monotonic) on.

    `wait` is fixed when the interrupt is made (the load then), so a rank's time does not shrink as the load falls.
    """

    at: float
    why: str
    wait: float = field(default_factory=_come_back)
    #: rank -> when its KeyboardInterrupt was sent.
    sent: dict[int, float] = field(default_factory=dict)
    #: Ranks known to have been in their user code when it was sent: they have `wait` s from then.
    in_code: set[int] = field(default_factory=set)

    def send_to(self, ranks: Iterable[int], now: float, in_code: bool) -> list[int]:
        """Of `ranks`, those to be interrupted now (each once); `in_code`: they are known to run their user code."""
        if now < self.at:
            return []
        new = [rank for rank in ranks if rank not in self.sent]
        for rank in new:
            self.sent[rank] = now
        if in_code:
            self.in_code.update(new)
        return new

    def deadline(self, rank: int) -> float:
        """When `rank` is stopped if it has not come back."""
        if rank in self.in_code:
            return self.sent[rank] + self.wait
        return self.at + LONGEST_COME_BACK

    def late(self, running: Iterable[int], now: float) -> list[int]:
        """The ranks of `running` whose time to come back is over."""
        return [rank for rank in running if now >= self.deadline(rank)]

    def not_back(self, ranks: list[int]) -> str:
        """Why the session ends when `ranks` did not come back in time."""
        given = max(self.deadline(rank) - self.sent.get(rank, self.at) for rank in ranks)
        return (
            f"rank(s) {', '.join(map(str, ranks))} did not come back from KeyboardInterrupt within {given:.3g} s "
            f"(interrupted because: {self.why}); a rank waiting in a collective (or in one long call into C) cannot, "
            "so every rank was stopped"
        )
