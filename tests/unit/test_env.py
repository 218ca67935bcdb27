"""The torchrun variables every launcher gives a rank."""

from __future__ import annotations

from air_magic.launch.env import cpu_launch_env, loopback_sockets, torchrun_env

#: What torchrun (torch.distributed.elastic's local agent) sets for each worker.
TORCHRUN = {
    "RANK",
    "LOCAL_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
}


def test_a_rank_gets_the_variables_torchrun_sets():
    """Rank 3 of 8 on the second of two nodes sees the names and values torchrun would give it, all strings."""
    env = torchrun_env(
        rank=7,
        world_size=8,
        local_rank=3,
        local_world_size=4,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29500,
        run_id="call-1",
    )
    assert TORCHRUN <= set(env)
    assert all(isinstance(v, str) for v in env.values())
    assert env["RANK"] == env["ROLE_RANK"] == "7" and env["LOCAL_RANK"] == "3"
    assert env["WORLD_SIZE"] == "8" and env["LOCAL_WORLD_SIZE"] == "4"
    assert env["NODE_RANK"] == env["GROUP_RANK"] == "1"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["TORCHELASTIC_RUN_ID"] == "call-1"


def test_without_an_agent_store_ranks_make_their_own():
    """When the launcher serves no store (no torch where it runs), the agent-store flag is left out."""
    env = torchrun_env(
        rank=0, world_size=1, local_rank=0, local_world_size=1, master_port=1, run_id="r", agent_store=False
    )
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_RESTART_COUNT"] == "0"


def test_loopback_sockets_keep_the_users_interface():
    """gloo and NCCL default to loopback, but an interface the user chose stays."""
    env = {"NCCL_SOCKET_IFNAME": "eth0"}
    loopback_sockets(env)
    assert env == {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "lo"}


def test_cpu_ranks_get_what_accelerate_launch_cpu_sets_unless_the_user_chose():
    """A CPU rank gets ACCELERATE_USE_CPU as `accelerate launch --cpu` sets it; a value the user set stays."""
    env: dict[str, str] = {}
    cpu_launch_env(env)
    assert env == {"ACCELERATE_USE_CPU": "True"}
    env = {"ACCELERATE_USE_CPU": "false"}
    cpu_launch_env(env)
    assert env == {"ACCELERATE_USE_CPU": "false"}
