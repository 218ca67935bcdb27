"""The listing `%distributed_session` prints: every live session's ranks (pid, node, device, memory in use, the
names each holds) and how long each waits idle, then what else the launchers keep between calls (Ray's hot ranks
and spare actors). It reads the sessions' records (sessions.py) and asks nothing of a busy rank."""

from __future__ import annotations

import socket
import time
from typing import Any

from .sessions import Sessions


def table(sessions_of: Sessions, launchers: Any) -> str:
    """Every live session: ranks, pids, node, device, memory in use, idle time left, and the names each holds; then
    what else a launcher keeps between calls (Ray's hot ranks and spare actors: what they hold, for how long)."""
    import psutil

    sessions = sessions_of.live()
    kept = [line for launcher in launchers.all_used() for line in launcher.held()]  # hot ranks, spares
    if not sessions:
        return "\n".join(["No session is alive. Start one with a `%%distributed --session [NAME]` cell.", *kept])
    host = socket.gethostname()
    here = {a.address for addresses in psutil.net_if_addrs().values() for a in addresses}
    lines: list[str] = []
    for record in sessions.values():
        left = max(0.0, record.keep_alive - (time.monotonic() - record.last_used))
        lines.append(f"session {record.name!r}: {record.shape()}, ends after {left:,.0f} s more idle")
        for rank in range(record.world_size):
            pid = record.pids.get(rank)
            node = record.hosts.get(rank, host if record.num_nodes == 1 else "(Ray)")
            try:  # a process of another machine is not looked at here
                local = pid and (record.num_nodes == 1 or node in here)
                memory = f"{psutil.Process(pid).memory_info().rss / 2**20:,.0f} MiB" if local else "?"
            except psutil.Error:
                memory = "gone"
            device = (
                f"cuda:{rank % max(1, record.world_size // record.num_nodes)}"
                if record.accelerator_type.startswith("GPU")
                else "cpu"
            )
            names = record.names.get(rank, {})
            held = "; ".join(f"{n}: {d}" for n, d in names.items()) or "(nothing assigned)"
            lines.append(f"  rank {rank}: pid {pid}, {node}, {device}, {memory} in use; {held}")
    return "\n".join(lines + kept)
