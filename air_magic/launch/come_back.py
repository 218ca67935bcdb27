"""How a session's call is asked to come back before its ranks are stopped, for every launcher.

A session's ranks that are still running when their call must end (a rank raised, Ctrl-C, Cancel, the
timeout) get a KeyboardInterrupt at `Interrupt.at` and have `COME_BACK` seconds to return to Python; those
that do not are stopped and the session ends. The local supervisor (local/supervisor.py) and the Ray pump
(ray/ending.py) keep one `Interrupt` per call and act on it; this module only holds the timing.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Seconds a session's ranks have to come back from KeyboardInterrupt before they are stopped (and the session ends).
COME_BACK = 5.0


@dataclass
class Interrupt:
    """A session call asked to come back: KeyboardInterrupt to its running ranks at `at` (monotonic), then
    `COME_BACK` s to return."""

    at: float
    why: str
    signalled: bool = False

    @property
    def give_up_at(self) -> float:
        return self.at + COME_BACK

    def not_back(self, ranks: str) -> str:
        """Why the session ends when `ranks` ("0, 1") did not come back in time."""
        return (
            f"rank(s) {ranks} did not come back from KeyboardInterrupt within {COME_BACK:g} s (interrupted because: "
            f"{self.why}); a rank waiting in a collective (or in one long call into C) cannot, "
            "so every rank was stopped"
        )
