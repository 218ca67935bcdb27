"""Spare actors on Ray: the actors of the next cold call of a shape, started ahead, and which call takes them.

A call that places new ranks waits for Ray to start one worker process per
rank and for each to import torch: seconds, where the call itself may take
a fraction of one. So after a call that placed its actors and ended them
(a cold call; not one kept as a hot world, whose next call needs no new
actors), a spare set for its shape is asked for at once: a
placement group and one actor per rank, as `Placement.reserve` makes them,
each importing the preload modules while it waits. The shape is what a call
must share with it: nodes, ranks per node, GPU or not, the runtime
environment of its packages (packages.py) and the preload modules. The next
call of that shape that places takes it instead of reserving, and its
actors then serve that one call as fresh ones would: `RankActor.start` sets
the call's environment, scratch directory and rank files. A spare is not a
hot rank: it has no process group, no user state, and never ran a call.

Spares live in the hot worlds' registry (hot.py, `HotWorld.spare`) and end
by its rules: idle `cluster.spare_idle()` seconds, a call of this notebook
waiting for what they hold, `release_hot()`, shutdown. A spare set with an
actor or a node lost, or whose placement group was moved, is ended when a
call would take it, and that call places anew. Sessions neither take nor
leave spares (a session's world is kept for its own calls).
Spares are on by default only for a Ray that `ray_init` started here; on a cluster
joined by address they are off unless `ray_init(spares=...)` asks (cluster.py).
This module decides; starting.py asks it
at placement, and the pump (pump.py) after a call.
"""

from __future__ import annotations

import json
from typing import Any

from .. import protocol as p
from ..boot import preload_modules
from ._compat import actor_id, actor_states
from .cluster import alive_nodes, require_connected, spare_idle
from .hot import HotWorld, HotWorlds
from .placement import Placement, end_actors


def spare_key(request: p.JobRequest, runtime_env: dict[str, Any] | None) -> str:
    """What a call must share with a spare set to run in it."""
    per_node = request.world_size // request.num_nodes
    env = json.dumps(runtime_env or {}, sort_keys=True, default=str)
    return f"spare/{request.num_nodes}x{per_node}/{request.use_gpu}/{','.join(preload_modules())}/{env}"


def take(owner: HotWorlds, request: p.JobRequest, runtime_env: dict[str, Any] | None) -> HotWorld | None:
    """The spare set of this call's shape, no longer kept (the call runs in it and ends it); None if there is none
    or it was lost (then it is ended here, and the call places anew)."""
    if request.session is not None:
        return None
    spare = owner.take_spare(spare_key(request, runtime_env))
    if spare is None:
        return None
    ray = require_connected()
    if _usable(ray, spare):
        return spare
    end_actors(ray, spare.actors, spare.pg, 1.0, ran=False)
    return None


def start(owner: HotWorlds, actor_cls: Any, request: p.JobRequest, runtime_env: dict[str, Any] | None) -> None:
    """After a call that placed and ended its actors: ask for a spare set of its shape, unless spares are off or one is
    kept."""
    idle = spare_idle()
    if not idle or request.session is not None:
        return
    key = spare_key(request, runtime_env)
    if any(w.key == key for w in owner.spare_sets()):
        return
    placement = Placement(require_connected(), request)
    placement.check_fits()  # a LaunchError (no spare) when a node of the call's is gone
    pg, actors = placement.reserve(actor_cls, f"air_magic-spare-{request.job_id[:8]}", runtime_env)
    owner.keep(HotWorld(key, actors, pg, [], "", 0, idle, busy=False, spare=True))
    if not spare_idle():  # ray_init turned spares off while this set was asked for
        owner.release_spares()


def _usable(ray: Any, spare: HotWorld) -> bool:
    """Its placement group is placed (or waits to be) on nodes alive, and none of its actors died."""
    from ray.util import placement_group_table

    try:
        table = placement_group_table(spare.pg)
    except Exception:  # noqa: BLE001 - a group Ray no longer knows
        return False
    state = table.get("state")
    alive = {n["NodeID"] for n in alive_nodes(ray)}
    nodes = set(table.get("bundles_to_node_id", {}).values())
    if state not in ("CREATED", "PENDING") or (state == "CREATED" and not nodes <= alive):
        return False
    states = actor_states([actor_id(a) for a in spare.actors])
    return states is None or "DEAD" not in states
