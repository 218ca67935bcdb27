"""The launcher variables of one rank: the only place they are written.

Every launcher (local, hot, Ray) builds a rank's environment with
`torchrun_env`, so a rank sees the same names and meanings whichever way it
was started, and as `torchrun` would set them (Lightning reads
TORCHELASTIC_RUN_ID to know it runs under torchrun). A CPU rank also gets
`cpu_launch_env`: what `accelerate launch --cpu` gives its processes, so a
plain `Accelerator()` joins the world instead of training alone. Every rank
gets `joined_init_env`. What else a launcher adds (its own bookkeeping
variables) it adds itself.
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
    run_id: str,
    restart_count: int = 0,
    max_restarts: int = 0,
    agent_store: bool = True,
) -> dict[str, str]:
    """What torchrun sets for one rank; `run_id`: the call's id, the same for every rank and every restart of it;
    `agent_store`: the launcher serves the TCPStore at MASTER_PORT."""
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
        "TORCHELASTIC_RUN_ID": run_id,
    }
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def cpu_launch_env(env: dict[str, str]) -> None:
    """What `accelerate launch --cpu` sets for its processes, where the user has not set it (CPU ranks only).

    Without ACCELERATE_USE_CPU, accelerate on a rank without a GPU sets up no process group: each rank
    trains alone on the whole data set. Its launcher also sets KMP_AFFINITY=compact, which pins every
    rank's Intel OpenMP threads to the same first cores of the machine: left out, as OMP_NUM_THREADS
    (set by the runner) already shares the cores between ranks.
    """
    env.setdefault("ACCELERATE_USE_CPU", "True")


def joined_init_env(env: dict[str, str]) -> None:
    """`init_process_group()` returns once every rank has joined the group, unless the user chose otherwise.

    Without it (torch 2.x's default), a rank leaves `init_process_group()` as soon as its own connections are made:
    a function or cell that returns right after it (`init_process_group("gloo")` then `get_rank()`) ends that rank's
    process while a slower peer still connects its gloo pairs to it, and the peer fails with "Connection closed by
    peer". torch's TORCH_DIST_INIT_BARRIER adds a barrier through the rendezvous store at the end of the call (two
    store requests a rank), after which every peer's connections are made.
    """
    env.setdefault("TORCH_DIST_INIT_BARRIER", "1")


def loopback_sockets(env: dict[str, str]) -> None:
    """Keep gloo's and NCCL's own sockets on loopback unless the user chose an interface (ranks of one machine)."""
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
