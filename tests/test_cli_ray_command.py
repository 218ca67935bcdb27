"""`air-magic run` of the runtime's multi-node form on two nodes of a (simulated) Ray cluster: `command` runs once
on each node with its NODE_RANK, the same MASTER_ADDR and MASTER_PORT, and each node's torchrun joins one world."""

from __future__ import annotations

import pytest
from helpers import air_magic_cli, kernel_env, process_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # Ray workers register slowly on a busy machine

TRAIN = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {total.item()}", flush=True)
dist.destroy_process_group()
"""

# The multi-node example's command, on 2 CPU nodes (compute.num_nodes is air_magic's, for CPU nodes).
JOB = """\
experiment_name: two-nodes
compute: {num_accelerators: 2, accelerator_type: CPU, num_nodes: 2}
code_source: {type: snapshot, snapshot: {root_path: code}}
max_retries: 0
timeout_minutes: 15
command: |
  cd $CODE_SOURCE_PATH
  echo "node $NODE_RANK of $NUM_NODES meets at $MASTER_ADDR:$MASTER_PORT"
  torchrun \\
    --nnodes=$NUM_NODES \\
    --node_rank=$NODE_RANK \\
    --nproc_per_node=${LOCAL_WORLD_SIZE:-8} \\
    --master_addr=$MASTER_ADDR \\
    --master_port=$MASTER_PORT \\
    train.py
"""


def test_a_command_on_two_nodes_runs_once_on_each_and_their_torchruns_meet(cluster, tmp_path):
    """Two CPU nodes of the cluster of RAY_ADDRESS: node 0 and node 1 each run the command once, with the same
    rendezvous, and the two torchrun ranks all-reduce across the nodes."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text(TRAIN)
    (tmp_path / "job.yaml").write_text(JOB)
    env = process_env({**kernel_env(tmp_path), "RAY_ADDRESS": cluster.address})
    done = air_magic_cli(tmp_path, env, "run", "-f", "job.yaml", "--watch", timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    meets = {line.split(" meets at ", 1)[1] for line in done.stdout.splitlines() if " meets at " in line}
    assert len(meets) == 1, done.stdout
    for node in (0, 1):
        assert f"[node {node}] node {node} of 2 meets at" in done.stdout
        assert f"rank {node} of 2 sum 3.0" in done.stdout
