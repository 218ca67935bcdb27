"""The torchrun variables of one rank: the only place they are written.

Every launcher (local, hot, Ray) builds a rank's environment with
`torchrun_env`, so a rank sees the same names and meanings whichever way it
was started, and as `torchrun` would set them. What else a launcher adds
(its own bookkeeping variables) it adds itself.
"""

from __future__ import annotations


def torchrun_env(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int,
    restart_count: int = 0,
    max_restarts: int = 0,
    agent_store: bool = True,
) -> dict[str, str]:
    """What torchrun sets for one rank; `agent_store`: the launcher serves the TCPStore at MASTER_PORT."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def loopback_sockets(env: dict[str, str]) -> None:
    """Keep gloo's and NCCL's own sockets on loopback unless the user chose an interface (ranks of one machine)."""
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
