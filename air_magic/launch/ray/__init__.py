"""The Ray launcher: ranks on several machines of a Ray cluster, behind the same Launcher interface.

cluster.py   ray_init, the "is this notebook connected" check, what the cluster holds
launcher.py  the notebook's side: a pump per call, the hot worlds, shutdown
pump.py      one call's thread: start it, watch the ranks, report events, tear down
starting.py  how a call's ranks start: in a hot world, a spare set or a new placement
received.py  what the ranks send back, kept in the run directory here as a local rank's files are
packages.py  the nodes' installed packages against the notebook's: brought with the call, or refused
placement.py the placement group and its actors, each rank's environment, ending actors
hot.py       hot worlds (keep_alive) and sessions' worlds: which call takes one, when one ends
spares.py    spare actor sets: the next cold call's actors started ahead, which call takes them
ending.py    a session's call: its ranks interrupted before they are stopped, the world kept or why it ends
deaths.py    Ray's bare actor deaths at a rank's start, as errors that say them and, where known, what to change
worker_log.py a dead actor's worker process: its exit as Ray saw it and the tail of its log
rank.py      what runs inside each rank's actor
_compat.py   the only uses of Ray's private names

Importing this package does not import Ray; a one-node call never comes here.
"""

from .cluster import ray_init, require_connected
from .launcher import RayLauncher

__all__ = ["RayLauncher", "ray_init", "require_connected"]
