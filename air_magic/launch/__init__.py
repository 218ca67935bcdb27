"""The process boundary: where ranks run, behind one Launcher interface, laid out by the process each part runs in.

In the notebook:
  interface.py  the Launcher and JobHandle the runner talks to (this module picks one: `launcher_for`)
  local/launcher.py, local/worlds.py, ray/  the launchers' notebook side (Ray's whole launcher runs in the
                notebook)
In the helper (one supervisor process per kernel, local calls only):
  local/        supervisor loop, preload cache, hot pools, spawning (everything but local/launcher.py and
                local/worlds.py)
  rendezvous.py the rendezvous store's own small process
In a rank (forked by the helper, spawned fresh, or a Ray actor):
  rank/         worker (runs a call), session namespace, carried notebook code, the rank's debugger
The run directory's formats (one module per file kind; every reader and writer uses it):
  files/        rundir (every path), rank_files (logs, usage, metrics), errorfile, stack_dumps,
                debug_channel, flight_recorder
Shared by every process:
  keeper.py     the one keeper of kept worlds (hot, session, spare) of the process that makes calls, shared by
                local/worlds.py (the helper's pools) and ray/hot.py (Ray's actors)
  protocol.py   the typed requests and events that cross a process
  env.py        the torchrun variables of a rank, for every launcher
  boot.py       how air_magic's own processes start (boot line, package location, internal-error exit code)
  come_back.py  how a session's call is asked to come back before its ranks are stopped
  load.py       how much longer this machine's load makes the waits in which another process must answer
  stacks.py     asking a rank where it is (the rank installs the handler, the helper or actor asks)
  stopper.py    stopping process trees (SIGTERM, grace, SIGKILL)

This module is the one door to the launchers: nothing outside launch/ imports local/ or ray/.
It picks the launcher of a call (`launcher_for`) and resolves the call's shape where that launcher
runs (`check_shape` at decoration, `resolve_shape` at the call), starts the local helper ahead of a
first call (`start_local_helper`), and keeps the launchers this kernel has used, so that preparing hooks,
releasing hot ranks and shutting down reach each of them without naming one. Nothing here
imports IPython, ipywidgets or MLflow.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, TypeVar

from .ray.cluster import ray_init

if TYPE_CHECKING:
    from .interface import Launcher
    from .keeper import World

__all__ = [
    "check_shape",
    "ended_sessions",
    "launcher_for",
    "prepare_hooks",
    "ray_init",
    "release_hot",
    "resolve_shape",
    "shutdown",
    "start_local_helper",
    "used",
    "used_launchers",
]

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


def prepare_hooks(hooks: list[str], env: dict[str, str]) -> None:
    """Ask every launcher this kernel has used to prepare these hook modules ahead of a call (see its prepare_hooks)."""
    for launcher in used_launchers():
        launcher.prepare_hooks(hooks, env)


def release_hot() -> None:
    """End the idle hot ranks of every launcher this kernel has used."""
    for launcher in used_launchers():
        launcher.release_hot()


def ended_sessions() -> list[tuple[World, str]]:
    """(world, why) for each session's world that ended outside any call (idle, released) since last asked, on
    any launcher: the record of this process's keeper of kept worlds."""
    from .keeper import kept

    return kept().ended_sessions()


def shutdown() -> None:
    """Stop every launcher this kernel has used, and whatever each still runs."""
    for launcher in used_launchers():
        launcher.shutdown()


def launcher_for(num_nodes: int) -> Launcher:
    """The launcher of a call over `num_nodes` machines: this node's local launcher for one, Ray's for several."""
    if num_nodes > 1:
        from .ray import ray_launcher

        return ray_launcher()
    from .local import local_launcher

    return local_launcher()


def check_shape(num: int | None, accelerator_type: str | None, num_nodes: int) -> tuple[int, str]:
    """Ranks per node and accelerator type, as far as they can be checked without starting anything (at decoration).

    One node: checked against this node. Several: only the form (no Ray is needed to decorate).
    Raises ConfigurationError if they don't fit.
    """
    if num_nodes > 1:
        from .ray.cluster import check_shape as check_ray_shape

        return check_ray_shape(num, accelerator_type)
    from ..accelerators import resolve

    return resolve(num, accelerator_type)


def resolve_shape(num: int | None, accelerator_type: str | None, num_nodes: int) -> tuple[int, str]:
    """Ranks per node and accelerator type of a call, asked of where it will run (the connected Ray cluster for
    several nodes, this node for one). Raises ConfigurationError if they don't fit."""
    if num_nodes > 1:
        from .ray.cluster import resolve

        return resolve(num, accelerator_type, num_nodes)
    return check_shape(num, accelerator_type, num_nodes)


def start_local_helper() -> None:
    """Start the local launcher's helper now, in the background (unless AIR_MAGIC_WARM turns warm starts off)."""
    from .boot import warm_default
    from .local import local_launcher
    from .local import start_helper as start

    if warm_default():
        used(local_launcher())  # its release and shutdown reach the helper from now on
        start()
