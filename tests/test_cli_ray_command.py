"""`air-magic run` of the runtime's multi-node form on two nodes of a (simulated) Ray cluster: `command` runs once
on each node with its NODE_RANK, the same MASTER_ADDR and MASTER_PORT, and each node's torchrun joins one world;
the ranks the torchruns started are the run's ranks on every node (their logs, usage and the watch across nodes)."""

from __future__ import annotations

import json

import pytest
from helpers import air_magic_cli, kernel_env, process_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # Ray workers register slowly on a busy machine

#: Rank 1 (on node 1) computes 0.15 s longer than rank 0 (on node 0) in each of 80 steps.
TRAIN = """\
import time
import torch, torch.distributed as dist
import air_magic
dist.init_process_group("gloo")
for step in range(80):
    if dist.get_rank() == 1:
        time.sleep(0.15)
    dist.all_reduce(torch.ones(1))
    air_magic.step()
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
    rendezvous, and the two torchrun ranks all-reduce across the nodes. Each rank's log, node and usage come back
    from its node (`logs --rank 1`, `get`), and the watch judges the two nodes' ranks together: rank 1, alone on its
    node, is named the straggler (by node 0, an ALERT of the run)."""
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
    run_id = done.stdout.split("Run ID: ", 1)[1].split()[0]
    got = json.loads(air_magic_cli(tmp_path, env, "get", run_id, "--json").stdout)["data"]
    assert [(r["rank"], r["node"]) for r in got["command_ranks"]] == [(0, 0), (1, 1)], got["command_ranks"]
    assert all(r["peak_memory"] > 50 * 2**20 for r in got["command_ranks"]), got["command_ranks"]  # torch imported
    alerts = {(a["kind"], a.get("rank")): a for a in got["alerts"]}
    assert ("straggler", 1) in alerts and "its compute" in alerts["straggler", 1]["line"], got["alerts"]
    assert alerts["straggler", 1]["node"] == 0  # named by node 0, which sees both nodes' ranks
    assert "ALERT" in done.stdout and "rank 1 is a straggler" in done.stdout, done.stdout
    rank_1 = air_magic_cli(tmp_path, env, "logs", run_id, "--rank", "1")
    assert rank_1.returncode == 0 and "rank 1 of 2 sum 3.0" in rank_1.stdout, rank_1.stdout + rank_1.stderr
    assert "rank 0 of 2" not in rank_1.stdout
