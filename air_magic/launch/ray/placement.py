"""Where a Ray call's ranks run: the placement group and its actors, each rank's environment, and their end.

For N nodes with k ranks each, a placement group of N bundles (k CPUs, and k
GPUs for GPU ranks) is asked for with STRICT_SPREAD, so each bundle is a
different machine and nothing starts until all of them are reserved. Rank r
is actor r % k of bundle r // k: ranks are ordered by node, then local rank.
The actors are asked for together with the placement group, and each
imports the preload modules (torch) while it waits for the call. Rank 0's
node gives MASTER_ADDR and a free MASTER_PORT, so an unchanged
`init_process_group()` meets there. This module does not watch a call (pump.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from functools import lru_cache
from typing import Any

from ...envvars import JOB, RAY_NODE_ID
from .. import protocol as p
from ..boot import PACKAGE_PARENT, preload_modules
from ..env import loopback_sockets, torchrun_env
from ._compat import actor_id, actor_states, free_per_node
from .cluster import alive_nodes

#: Variables of the notebook that describe its own machine, not the ranks' machines.
NODE_LOCAL_ENV = frozenset(
    {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_"}
)


class LaunchError(Exception):
    """The job cannot be placed or started; the message says why."""


def _resources(res: dict[str, float], keys: tuple[str, ...]) -> str:
    return ", ".join(f"{res.get(k, 0):g} {k}" for k in keys)


class Placement:
    """What one call asks of the cluster: N bundles of k ranks' resources, one per machine."""

    def __init__(self, ray: Any, request: p.JobRequest) -> None:
        self.ray = ray
        self.request = request
        self.nodes, self.per_node = request.num_nodes, request.world_size // request.num_nodes
        k = float(self.per_node)
        self.bundle = {"CPU": k, **({"GPU": k} if request.use_gpu else {})}
        self.keys = tuple(self.bundle)
        self.asked = f"{self.nodes} node(s) with {_resources(self.bundle, self.keys)} each"

    def check_fits(self) -> None:
        """A LaunchError at once when fewer machines than asked could ever hold a bundle."""
        totals = [n.get("Resources", {}) for n in alive_nodes(self.ray)]
        fit = [t for t in totals if all(t.get(key, 0) >= v for key, v in self.bundle.items())]
        if len(fit) < self.nodes:
            raise LaunchError(
                f"the Ray cluster cannot hold this call: asked for {self.asked}, but only {len(fit)} of its "
                f"{len(totals)} node(s) have that much. {self.free_text()}"
            )

    def free_now(self) -> bool:
        """Enough machines have a bundle's resources free now: a group waiting for them is about to be placed.

        False where Ray no longer says what is free.
        """
        free = free_per_node()
        fit = [r for r in (free or {}).values() if all(r.get(k, 0) >= v for k, v in self.bundle.items())]
        return len(fit) >= self.nodes

    def free_text(self) -> str:
        """What each node has free now, for an error message."""
        free = free_per_node()
        if free is None:
            return ""
        nodes = {n["NodeID"]: n for n in alive_nodes(self.ray)}
        parts = [
            f"{nodes[nid].get('NodeManagerAddress', '?')} ({nid[:8]}): {_resources(res, self.keys)}"
            for nid, res in free.items()
            if nid in nodes
        ]
        return "Free now: " + ("; ".join(parts) or "nothing") + "."

    def reserve(self, actor_cls: Any, name: str, runtime_env: dict[str, Any] | None) -> tuple[Any, list[Any]]:
        """The placement group and, at once, one actor per rank in it (Ray starts them once the group is placed);
        `runtime_env`: what packages.prepare asked for the actors, if anything."""
        from ray.util.placement_group import placement_group

        pg = placement_group([self.bundle] * self.nodes, strategy="STRICT_SPREAD", name=name)
        return pg, [self.actor(actor_cls, pg, rank, runtime_env) for rank in range(self.request.world_size)]

    def actor(self, actor_cls: Any, pg: Any, rank: int, runtime_env: dict[str, Any] | None) -> Any:
        """Rank `rank`'s actor in its bundle of `pg` (asked for now; Ray starts it once the group is placed)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return actor_cls.options(
            num_cpus=1,
            num_gpus=1 if self.request.use_gpu else 0,
            max_concurrency=4,
            max_restarts=0,
            **({"runtime_env": runtime_env} if runtime_env else {}),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank // self.per_node
            ),
        ).remote(PACKAGE_PARENT, preload_modules())


def rank_envs(request: p.JobRequest, places: list[p.ActorPlace], master: str, port: int, run_id: str) -> list[dict]:
    """Each rank's whole environment for one call: the notebook's (less what names its own machine) and torchrun's."""
    k = request.world_size // request.num_nodes
    base = {
        key: v
        for key, v in request.env.items()
        if key not in NODE_LOCAL_ENV and not key.startswith("RAY_") and key != "RAYLET_PID"
    }
    if all(i.ip.startswith("127.") or i.ip == "::1" for i in places):
        loopback_sockets(base)  # nodes of one machine (a simulated cluster): gloo and NCCL on loopback as locally
    base[JOB] = request.job_id
    envs = []
    for rank in range(request.world_size):
        node, local = divmod(rank, k)
        env = {**base, RAY_NODE_ID: places[rank].node_id}
        env.update(
            torchrun_env(
                rank=rank,
                world_size=request.world_size,
                local_rank=local,
                local_world_size=k,
                node_rank=node,
                master_addr=master,
                master_port=port,
                run_id=run_id,  # the call's: the same for each of its restarts
                agent_store=False,
                restart_count=request.restart_count,
                max_restarts=request.max_restarts,
            )
        )
        if request.use_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu for i in places[node * k : (node + 1) * k] for gpu in i.gpus[:1])
        envs.append(env)
    return envs


def code_dirs(sys_path: list[str]) -> list[str]:
    """The notebook's `sys.path` less its installed-package directories: a node imports installed packages from its
    own environment (the one packages.py compares), and the notebook's own modules travel with the call."""
    return [entry for entry in sys_path if not _installs(entry)]


@lru_cache(maxsize=256)
def _installs(entry: str) -> bool:
    real = os.path.realpath(entry or ".")
    if any(real == root or real.startswith(os.path.join(root, "")) for root in _prefixes()):
        return True
    try:
        return any(name.endswith((".dist-info", ".egg-info")) for name in os.listdir(real))
    except OSError:
        return False


@lru_cache(maxsize=1)
def _prefixes() -> tuple[str, ...]:
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return tuple(os.path.realpath(p) for p in paths if p and os.path.realpath(p) != os.sep)


def end_actors(ray: Any, actors: list[Any], pg: Any, grace: float, ran: bool = True) -> None:
    """End the ranks' child processes, kill every actor, remove the placement group, wait until they are gone.

    `ran=False`: actors that never ran a call (spares) have nothing to end first; they are killed at once.
    """
    if actors:
        if ran:
            ends = [a.terminate.remote(grace) for a in actors]
            # dead actors answer with errors; every actor is killed below anyway
            with contextlib.suppress(Exception):
                ray.wait(ends, num_returns=len(ends), timeout=grace + 6)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        _wait_dead(actors, 10.0)
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(pg)


def _wait_dead(actors: list[Any], limit: float) -> None:
    deadline = time.monotonic() + limit
    ids = [actor_id(a) for a in actors]
    while time.monotonic() < deadline:
        states = actor_states(ids)
        if states is None or all(s == "DEAD" for s in states):
            return
        time.sleep(0.05)
