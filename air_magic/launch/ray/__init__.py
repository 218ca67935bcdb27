"""The Ray launcher: ranks on several machines of a Ray cluster, behind the same Launcher interface.

cluster.py   ray_init, the "is this notebook connected" check, what the cluster holds
launcher.py  the notebook's side: placement group, one actor per rank, events for the runner
rank.py      what runs inside each rank's actor

Importing this package does not import Ray; a one-node call never comes here.
"""

from .cluster import ray_init, require_connected
from .launcher import RayLauncher, ray_launcher

__all__ = ["RayLauncher", "ray_init", "ray_launcher", "require_connected"]
