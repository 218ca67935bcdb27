"""The watch of a command run on several nodes: every node's ranks judged together, on node 0.

Each node's watch (cli/command_watch.py) reads the step files of the ranks its own command started. A straggler or
a hang is only seen against the other ranks, and those are on the other nodes, so on several nodes the nodes meet
in the store that already tells them the command's MASTER_PORT (cli/node.py; a TCPStore at the call's own address,
served by node 0): each other node puts there, at each look, its ranks' step files as they are and which of its
ranks still run (`air_magic/watch/<attempt>/node_<n>`); node 0 reads them and judges every rank of the run. A
hung rank of another node is asked for its stacks through the store as well (a count per rank, which its node's
watch answers by sending the rank the stacks signal), its stacks land in that node's `rank_<R>.stacks`, which
comes back to the caller's run directory with the node's other files (launch/files/node_mirror.py).

A store that stops answering (node 0 ended first) ends the exchange quietly: each node keeps watching its own ranks.
Not for: the rules (watching/detector.py) or the files (cli/command_rank.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..launch.files import step_times
from ..launch.files.step_times import RankSteps


@dataclass(frozen=True)
class RemoteRank:
    """A rank of another node, as its node last put it in the store."""

    node: int
    state: RankSteps | None
    running: bool


class WatchPeers:
    """One node's side of the exchange; `judge` is True on node 0, which reads the others and judges for all."""

    def __init__(self, store: Any, node: int, num_nodes: int, attempt: int) -> None:
        self.store, self.node, self.num_nodes = store, node, num_nodes
        self.prefix = f"air_magic/watch/{attempt}"
        self.answered: dict[int, int] = {}  # rank -> stacks requests answered
        self.broken = False

    @property
    def judge(self) -> bool:
        return self.node == 0

    def _call(self, method: str, *args: Any) -> Any:
        if self.broken:
            return None
        try:
            return getattr(self.store, method)(*args)
        except Exception:  # noqa: BLE001 - node 0's store is gone: each node watches its own ranks from now on
            self.broken = True
            return None

    def publish(self, steps: dict[int, bytes | None], running: set[int]) -> None:
        """Put this node's ranks in the store: each one's step file as it is, and whether it still runs."""
        ranks = {
            str(rank): {"steps": data.decode(errors="replace") if data else None, "running": rank in running}
            for rank, data in steps.items()
        }
        self._call("set", f"{self.prefix}/node_{self.node}", json.dumps(ranks))

    def others(self) -> dict[int, RemoteRank]:
        """Every rank the other nodes last put in the store (node 0 reads them)."""
        found: dict[int, RemoteRank] = {}
        for node in range(self.num_nodes):
            key = f"{self.prefix}/node_{node}"
            if node == self.node or not self._call("check", [key]):
                continue
            raw = self._call("get", key)
            try:
                ranks = json.loads(raw) if raw is not None else {}
            except ValueError:
                continue
            for rank, entry in ranks.items():
                data = entry.get("steps")
                state = step_times.decode(data.encode()) if data else None
                found[int(rank)] = RemoteRank(node, state, bool(entry.get("running")))
        return found

    def ask_stacks(self, rank: int) -> None:
        """Ask the node of rank `rank` (another one) to have it write its stacks."""
        self._call("add", f"{self.prefix}/stacks/{rank}", 1)

    def stacks_asked(self, ranks: set[int]) -> list[int]:
        """Which of this node's `ranks` node 0 asked for their stacks since the last look."""
        asked = []
        for rank in sorted(ranks):
            count = self._call("add", f"{self.prefix}/stacks/{rank}", 0)
            if count is not None and int(count) > self.answered.get(rank, 0):
                self.answered[rank] = int(count)
                asked.append(rank)
        return asked
