"""How many nodes a workload file asks for, how many GPUs each, and whether this machine can be that node.

The runtime reads `compute.num_accelerators` as the total over all nodes and `compute.accelerator_type` as one
node's hardware (`GPU_8xH100`: 8 GPUs a node), so 16 x `GPU_8xH100` is 2 nodes of 8. `of(compute)` gives that
`Topology`; `Topology.refusal(node)` says in one line why this machine cannot be its one node, with the
`--override` that fits, or None; several nodes are the Ray cluster's this machine joined. `CPU` (air_magic's) is
`num_accelerators` CPU processes on one node, or over `compute.num_nodes` nodes. Not for: starting anything
(cli/node.py runs the command once per node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..accelerators import Node, parse_gpu_type
from .schema import JobFileError

#: The runtime's accelerator types.
RUNTIME_TYPES = ("GPU_1xA10", "GPU_1xH100", "GPU_8xH100")


@dataclass(frozen=True)
class Topology:
    """The nodes a workload runs on: `nodes` nodes of `per_node` accelerators of `accelerator_type`."""

    nodes: int
    per_node: int
    accelerator_type: str

    @property
    def uses_gpu(self) -> bool:
        return self.accelerator_type.upper() != "CPU"

    @property
    def total(self) -> int:
        return self.nodes * self.per_node

    def refusal(self, node: Node) -> str | None:
        """Why this machine cannot be the run's only node, with the override that fits; None if it can (or if the
        run has several nodes: those are the Ray cluster's, checked when it starts)."""
        if self.nodes > 1:
            return None
        here = f"{node.gpu_count} GPU(s) ({node.gpu_model})" if node.gpu_count else "no GPU"
        if self.uses_gpu and not node.gpu_count:
            return (
                f"compute asks for {self.per_node} GPU(s) per node ({self.accelerator_type}) and this machine has "
                "no GPU; run on its CPU with --override compute.accelerator_type=CPU"
            )
        if self.uses_gpu and self.per_node > node.gpu_count:
            fits = f"GPU_{node.gpu_count}x{node.gpu_model}"
            return (
                f"compute asks for {self.per_node} GPUs per node ({self.accelerator_type}) and this machine has "
                f"{here}; run on them with --override compute.accelerator_type={fits} "
                f"--override compute.num_accelerators={node.gpu_count}"
            )
        return None

    def one_node(self) -> str:
        """The override that makes the run one node."""
        if self.accelerator_type == "CPU":
            return "--override compute.num_nodes=1"
        return f"--override compute.num_accelerators={self.per_node}"


def of(compute: dict[str, Any]) -> Topology:
    """The topology `compute` asks for; JobFileError naming the field that does not say it."""
    num = compute.get("num_accelerators")
    kind = compute.get("accelerator_type")
    if kind is None:
        raise JobFileError(
            f"compute.accelerator_type is required: one of {', '.join(RUNTIME_TYPES)}, or CPU (air_magic's, for "
            "a machine without GPUs)"
        )
    if num is None:
        raise JobFileError("compute.num_accelerators is required: the GPUs of all nodes together")
    if num < 1:
        raise JobFileError(f"compute.num_accelerators must be at least 1, got {num}")
    if kind.strip().upper() == "CPU":  # air_magic's: num_nodes CPU machines of a Ray cluster, num / num_nodes each
        nodes = compute.get("num_nodes") or 1
        if num % nodes:
            raise JobFileError(
                f"compute.num_accelerators for {nodes} CPU nodes must be a multiple of {nodes}, got {num}"
            )
        return Topology(nodes, num // nodes, "CPU")
    parsed = parse_gpu_type(kind)
    if parsed is None or parsed[0] is None or parsed[1] is None:
        raise JobFileError(
            f"compute.accelerator_type must be one of {', '.join(RUNTIME_TYPES)} (or CPU, or GPU_<n>x<model> for "
            f"another GPU), got {kind!r}"
        )
    per_node = parsed[0]
    if num % per_node:
        raise JobFileError(f"compute.num_accelerators for {kind} must be a multiple of {per_node}, got {num}")
    if compute.get("num_nodes") is not None:
        raise JobFileError(
            f"compute.num_nodes is for CPU and function workloads; with {kind} the nodes are num_accelerators / "
            f"{per_node}"
        )
    return Topology(num // per_node, per_node, kind)
