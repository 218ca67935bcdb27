"""How much longer this machine's load makes the waits in which another process must answer: one factor for all.

A process given 1 s to answer on an idle machine may not even be scheduled in that time when the cores are
overloaded. The limits that judge another process by how soon it answers (the stacks a stop or a Stacks click asks
for, a session rank's return from KeyboardInterrupt) are multiplied by `patience()`, read when the wait starts.
They still end within a bound. Used by the helper, the notebook and the Ray pump; imports nothing of air_magic.
"""

from __future__ import annotations

import os

#: The most a limit is stretched: a stop on an overloaded machine still ends within a bound.
MOST_PATIENCE = 10.0


def patience() -> float:
    """How many times a limit is stretched now: the load average per core, from 1 to MOST_PATIENCE (at a load of
    17 on 2 cores, a process given 1 s on an idle machine is given 8.5 s)."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return 1.0
    return min(MOST_PATIENCE, max(1.0, per_core))
