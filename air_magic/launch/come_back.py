"""How a session's call is asked to come back before its ranks are stopped, for every launcher.

A session's ranks that are still running when their call must end (a rank raised, Ctrl-C, Cancel, the
timeout) get a KeyboardInterrupt at `Interrupt.at` and have `COME_BACK` seconds to return to Python, stretched by
this machine's load (load.py) as the interrupt is made; those that do not are stopped and the session ends. The
local supervisor (local/supervisor.py) and the Ray pump (ray/ending.py) keep one `Interrupt` per call and act on
it; this module only holds the timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .load import MOST_PATIENCE, patience

#: Seconds a session's ranks have to come back from KeyboardInterrupt before they are stopped (and the session ends),
#: on an idle machine.
COME_BACK = 5.0
#: The most they are given, on the busiest machine: what a caller waiting for the call's end allows for it.
LONGEST_COME_BACK = COME_BACK * MOST_PATIENCE


def _come_back() -> float:
    return COME_BACK * patience()


@dataclass
class Interrupt:
    """A session call asked to come back: KeyboardInterrupt to its running ranks at `at` (monotonic), then `wait`
    seconds to return (`COME_BACK`, longer on a busy machine: a rank still loading the call, or not scheduled, needs
    the time to reach Python)."""

    at: float
    why: str
    signalled: bool = False
    wait: float = field(default_factory=_come_back)

    @property
    def give_up_at(self) -> float:
        return self.at + self.wait

    def not_back(self, ranks: str) -> str:
        """Why the session ends when `ranks` ("0, 1") did not come back in time."""
        return (
            f"rank(s) {ranks} did not come back from KeyboardInterrupt within {self.wait:.3g} s (interrupted because: "
            f"{self.why}); a rank waiting in a collective (or in one long call into C) cannot, "
            "so every rank was stopped"
        )
