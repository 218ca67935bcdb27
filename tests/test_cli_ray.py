"""`air-magic run` of a function workload on two nodes of a (simulated) Ray cluster: one rank on each, their lines
followed with --watch, exit code 0."""

from __future__ import annotations

import re

import pytest
from helpers import air_magic_cli, kernel_env, process_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # Ray workers register slowly on a busy machine

JOB = """\
compute: {num_accelerators: 1, accelerator_type: CPU, num_nodes: 2}
function: fns:where
timeout_minutes: 15
max_retries: 0
"""

FUNCTIONS = """\
import os

def where():
    node = os.environ["AIR_MAGIC_RAY_NODE_ID"]
    print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "on node", node, flush=True)
"""


def test_a_workload_on_two_nodes_runs_a_rank_on_each(cluster, tmp_path):
    """compute.num_nodes: 2 (air_magic's, for function workloads) joins the cluster of RAY_ADDRESS and runs the
    function's two ranks on its two worker nodes, one on each."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    env = process_env({**kernel_env(tmp_path), "RAY_ADDRESS": cluster.address})
    done = air_magic_cli(tmp_path, env, "run", "-f", "job.yaml", "--watch", timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    # each rank says the Ray node its actor runs on (AIR_MAGIC_RAY_NODE_ID, from the actor's own runtime context)
    nodes = dict(re.findall(r"^\[rank (\d)\] rank \1 of 2 on node (\w+)$", done.stdout, re.MULTILINE))
    assert sorted(nodes) == ["0", "1"], done.stdout
    assert nodes["0"] != nodes["1"] and set(nodes.values()) == {n.node_id for n in cluster.worker_nodes}, nodes
