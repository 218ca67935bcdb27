"""What a process and all its descendants use now: CPU % (100 = one core) and resident bytes, sampled again and again.

psutil's `cpu_percent(interval=None)` measures from one reading of a process to the next, so each process seen is
kept between samples (its first reading says 0). Used wherever a rank's tree is sampled: the notebook's sampler of
its local ranks (resources.py), a Ray rank's own actor (ray/rank.py) and a node's watch of a command run's ranks
(cli/command_watch.py). Never sleeps; knows nothing of calls.
"""

from __future__ import annotations

import psutil


class TreeUsage:
    """`sample(pid)`: the CPU % and resident bytes of process `pid` and its descendants, or None once it has ended."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        #: The pids of the tree that the last `sample` read (its root first).
        self.last_tree: list[int] = []

    def sample(self, pid: int) -> tuple[float, int] | None:
        root = self._process(pid)
        if root is None:
            return None
        try:
            children = root.children(recursive=True)
        except psutil.Error:
            return None
        cpu, memory = 0.0, 0
        self.last_tree = []
        for proc in [root, *(self._process(child.pid) for child in children)]:
            if proc is None:
                continue
            self.last_tree.append(proc.pid)
            try:
                with proc.oneshot():
                    cpu += proc.cpu_percent(interval=None)
                    memory += proc.memory_info().rss
            except psutil.Error:
                continue
        return cpu, memory

    def _process(self, pid: int) -> psutil.Process | None:
        """The process `pid` as last seen (the same object: its CPU reading goes on), None if ended or a zombie."""
        proc = self._procs.get(pid)
        try:
            if proc is None or not proc.is_running():
                proc = psutil.Process(pid)
                proc.cpu_percent(interval=None)  # the first reading only starts the measurement
                self._procs[pid] = proc
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except psutil.Error:
            self._procs.pop(pid, None)
            return None
        return proc
