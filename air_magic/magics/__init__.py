"""IPython glue for air_magic, by topic as IPython's own magics are: the %%distributed cell magic and its
configured defaults (execution.py), the magics of calls (calls.py), of sessions and hot ranks (sessions.py) and of
the debugger (debug.py); each option is declared once (options.py). Registering them all, `%load_ext air_magic`,
and removing them, `%unload_ext air_magic`, are here.

Only glue lives in this package: the logic is in plain modules that run without IPython.
"""

from __future__ import annotations

from typing import Any

from IPython.core.magic import Magics

from .. import notebook_code
from ..owner import owner
from .calls import CallMagics
from .debug import DebugMagics
from .execution import DistributedMagics
from .sessions import SessionMagics

__all__ = ["MAGICS", "DistributedMagics", "load_ipython_extension", "unload_ipython_extension"]

#: Every class of air_magic's magics, registered by `%load_ext air_magic` and removed by `%unload_ext`.
MAGICS: tuple[type[Magics], ...] = (DistributedMagics, CallMagics, SessionMagics, DebugMagics)


def load_ipython_extension(ipython: Any) -> None:
    """Register %%distributed and the line magics; loading again is harmless."""
    for magics in MAGICS:
        if magics.__name__ not in ipython.magics_manager.registry:
            ipython.register_magics(magics)
    if notebook_code.remember not in ipython.events.callbacks["post_run_cell"]:
        ipython.events.register("post_run_cell", notebook_code.remember)  # the notebook's modules as imported


def unload_ipython_extension(ipython: Any) -> None:
    """Remove %%distributed and the line magics, and stop every launcher this kernel used (and any worker each
    still has)."""
    manager = ipython.magics_manager
    configurables = getattr(ipython, "configurables", [])
    for cls in MAGICS:
        magics = manager.registry.pop(cls.__name__, None)
        if magics is None:
            continue
        for table in manager.magics.values():
            for name, func in list(table.items()):
                if getattr(func, "__self__", None) is magics:
                    del table[name]
        if magics in configurables:
            configurables.remove(magics)
    owner().shutdown()
