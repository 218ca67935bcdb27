"""The Ray launcher: the ranks of a call as Ray actors on several machines, behind the same Launcher interface.

Each call gets a pump (pump.py) and idle hot worlds wait here (hot.py); the
other rooms of this package are listed in its __init__.py.
"""

from __future__ import annotations

import atexit
import re
import threading
import time
from typing import Any

from .. import protocol as p
from ..files.rundir import RunDir
from ..interface import ENDED_BY_USER, Launcher
from ..keeper import Keeper
from .cluster import require_connected, spares_off
from .hot import HotWorld
from .pump import RayJob
from .rank import RankActor
from .starting import JobLauncher


class RayLauncher(JobLauncher, Launcher):
    """Ranks on the nodes of the Ray cluster this notebook joined with `ray_init`; hot ranks and sessions kept as
    `HotWorld`s."""

    supports = frozenset({"keep_alive", "session"})

    def __init__(self, keeper: Keeper) -> None:
        super().__init__(keeper)
        self._lock = threading.Lock()
        self._jobs: set[RayJob] = set()
        self._actor_class: Any = None
        self._probe: Any = None
        self._atexit = False
        spares_off(self.release_spares)

    def actor_class(self) -> Any:
        """RankActor as a Ray actor class (made once: Ray ships it to the nodes at its first use)."""
        if self._actor_class is None:
            import ray
            from ray import cloudpickle

            from . import rank

            cloudpickle.register_pickle_by_value(rank)  # the nodes need not import this module (see rank.py)
            self._actor_class = ray.remote(RankActor)
        return self._actor_class

    def probe_task(self) -> Any:
        """rank.installed_versions as a Ray task of no CPU (packages.py sends it to each node once)."""
        if self._probe is None:
            import ray

            self.actor_class()  # rank.py registered by value
            from .rank import installed_versions

            self._probe = ray.remote(num_cpus=0, max_retries=0)(installed_versions)
        return self._probe

    def start(self, request: p.JobRequest, run_dir: RunDir) -> RayJob:
        ray = require_connected()
        with self._lock:
            if not self._atexit:  # registered after ray.init's own: runs before Ray disconnects at exit
                atexit.register(self.shutdown)
                self._atexit = True
            job = RayJob(self, request, run_dir, ray)
            self._jobs.add(job)
        return job

    def forget(self, job: RayJob) -> None:
        with self._lock:
            self._jobs.discard(job)

    def end_session(self, name: str, why: str = ENDED_BY_USER) -> None:
        """End session `name`'s world now, saying `why`: idle, at once; running a call, that call is stopped and
        ends it."""
        if self.end_idle_session(name, why):
            return
        with self._lock:
            jobs = [j for j in self._jobs if j.world is not None and j.world.session == name]
        for job in jobs:
            job.end_session(why)

    def held(self) -> list[str]:
        now = time.monotonic()
        return [held_line(w, now) for w in self.hot_worlds() + self.spare_sets() if w.session is None]

    def shutdown(self, timeout: float = 20.0) -> None:
        """Stop every job still running, wait for its teardown, and end every hot world (at exit, on unload)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.stop("shutdown", 1.0)
        deadline = time.monotonic() + timeout
        for job in jobs:
            job.thread.join(max(0.0, deadline - time.monotonic()))
        self.end_all()


def held_line(world: HotWorld, now: float) -> str:
    """What one kept world holds on the cluster and for how long (`now`: time.monotonic())."""
    shape = re.match(r"(\d+)x(\d+)/(True|False)", world.shape)  # hot.world_key, spares.spare_key
    nodes, per_node, gpu = (int(shape[1]), int(shape[2]), shape[3] == "True") if shape else (0, 0, False)
    each = f"{per_node} CPU" + (f" and {per_node} GPU" if gpu else "")
    if world.busy or world.idle_since is None:
        when = "running a call"
    else:
        idle = now - world.idle_since
        when = f"idle {idle:,.0f} s, ends after {max(0.0, world.keep_alive - idle):,.0f} s more idle"
    what = "spare actors" if world.spare else "hot ranks"
    return f"Ray {what}: {nodes} node(s) with {each} each; {when} (%distributed_release ends them)"
