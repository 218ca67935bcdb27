"""The process boundary: where ranks run, behind one Launcher interface.

interface.py  the Launcher and JobHandle the runner talks to
protocol.py   the typed requests and events that cross the boundary
rundir.py     the run directory: its layout and privacy (the only place its paths are built)
env.py        the torchrun variables of a rank, for every launcher
boot.py       how air_magic's own processes start (boot line, package location, internal-error exit code)
stopper.py    stopping process trees (SIGTERM, grace, SIGKILL) for every helper
local/        the local launcher: one supervisor process per kernel, ranks on this machine
rendezvous.py worker.py errorfile.py   what runs in the store and rank processes, whichever launcher started them
ray/          the Ray launcher: ranks as Ray actors on several machines (imports Ray only when used)

This module also keeps the launchers this kernel has used, so that warming up,
releasing hot ranks and shutting down reach each of them without naming one. Nothing here
imports IPython, ipywidgets or MLflow.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .interface import Launcher

L = TypeVar("L", bound="Launcher")
_used: list[Launcher] = []
_lock = threading.Lock()


def used(launcher: L) -> L:
    """Note that this kernel uses `launcher` (once); returns it."""
    with _lock:
        if not any(known is launcher for known in _used):
            _used.append(launcher)
    return launcher


def used_launchers() -> list[Launcher]:
    """The launchers this kernel has used, first used first."""
    with _lock:
        return list(_used)


def warm_up(hooks: list[str], env: dict[str, str]) -> None:
    """Ask every launcher this kernel has used to warm up these hook modules ahead of a call (see Launcher.warm_up)."""
    for launcher in used_launchers():
        launcher.warm_up(hooks, env)


def release_hot() -> None:
    """End the idle hot ranks of every launcher this kernel has used."""
    for launcher in used_launchers():
        launcher.release_hot()


def shutdown() -> None:
    """Stop every launcher this kernel has used, and whatever each still runs."""
    for launcher in used_launchers():
        launcher.shutdown()
