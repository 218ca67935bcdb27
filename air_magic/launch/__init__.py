"""The process boundary: where ranks run, behind one Launcher interface, laid out by the process each part runs in.

In the notebook:
  interface.py  the Launcher and JobHandle the runner talks to (this module picks one: `Launchers.for_nodes`)
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
  keeper.py     the keeper of kept worlds (hot, session, spare) of the process that makes calls (its owner
                holds it), handed to local/worlds.py (the helper's pools) and ray/hot.py (Ray's actors)
  protocol.py   the typed requests and events that cross a process
  env.py        the torchrun variables of a rank, for every launcher
  boot.py       how air_magic's own processes start (boot line, package location, internal-error exit code)
  come_back.py  how a session's call is asked to come back before its ranks are stopped
  load.py       how much longer this machine's load makes the waits in which another process must answer
  stacks.py     asking a rank where it is (the rank installs the handler, the helper or actor asks)
  stopper.py    stopping process trees (SIGTERM, grace, SIGKILL)

This module is the one door to the launchers: nothing outside launch/ imports local/ or ray/.
`Launchers` (one per process that makes calls, held by its owner with its keeper) picks the launcher of a call
(`for_nodes`), starts the local helper ahead of a first call, and keeps the launchers used, so that preparing hooks,
releasing hot ranks and shutting down reach each of them without naming one. `check_shape` (at decoration) and
`resolve_shape` (at the call) resolve a call's shape where its launcher runs. Nothing here
imports IPython, ipywidgets or MLflow.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TypeVar

from .ray.cluster import ray_init

if TYPE_CHECKING:
    from .interface import Launcher
    from .keeper import Keeper
    from .local import LocalLauncher
    from .ray import RayLauncher

__all__ = [
    "Launchers",
    "check_shape",
    "ray_init",
    "resolve_shape",
]


L = TypeVar("L", bound="Launcher")


class Launchers:
    """The launchers of one process that makes calls, all handed its one keeper of kept worlds; the owner
    (air_magic/owner/) holds one. It picks a call's launcher (`for_nodes`) and remembers the ones used, so that
    preparing hooks, releasing hot ranks and shutting down reach each of them without naming one."""

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper
        self._used: list[Launcher] = []
        self._lock = threading.Lock()
        self._local: Any = None
        self._ray: Any = None

    @property
    def local(self) -> LocalLauncher:
        """This process's local launcher (made at first use; it starts its helper only when asked)."""
        with self._lock:
            if self._local is None:
                from .local import LocalLauncher

                self._local = LocalLauncher(self.keeper)
            return self._local  # type: ignore[no-any-return]

    @property
    def ray(self) -> RayLauncher:
        """This process's Ray launcher (made at first use; Ray is imported only when a call places ranks)."""
        with self._lock:
            if self._ray is None:
                from .ray import RayLauncher

                self._ray = RayLauncher(self.keeper)
            return self._ray  # type: ignore[no-any-return]

    def used(self, launcher: L) -> L:
        """Note that this process uses `launcher` (once); returns it."""
        with self._lock:
            if not any(known is launcher for known in self._used):
                self._used.append(launcher)
        return launcher

    def all_used(self) -> list[Launcher]:
        """The launchers this process has used, first used first."""
        with self._lock:
            return list(self._used)

    def for_nodes(self, num_nodes: int) -> Launcher:
        """The launcher of a call over `num_nodes` machines: this node's local launcher for one, Ray's for several."""
        return self.ray if num_nodes > 1 else self.local

    def prepare_hooks(self, hooks: list[str], env: dict[str, str]) -> None:
        """Ask every launcher used to prepare these hook modules ahead of a call (see its prepare_hooks)."""
        for launcher in self.all_used():
            launcher.prepare_hooks(hooks, env)

    def release_hot(self) -> None:
        """End the idle hot ranks of every launcher used."""
        for launcher in self.all_used():
            launcher.release_hot()

    def shutdown(self) -> None:
        """Stop every launcher used, and whatever each still runs."""
        for launcher in self.all_used():
            launcher.shutdown()

    def start_local_helper(self) -> None:
        """Start the local launcher's helper now, in the background (unless AIR_MAGIC_WARM turns warm starts off)."""
        from .boot import warm_default

        if warm_default():
            self.used(self.local).client()  # its release and shutdown reach the helper from now on


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
