"""Hot ranks in the helper: the processes and pipes of kept worlds, adapted to the keeper (launch/keeper.py).

A call with `keep_alive` leaves its workers alive, each waiting on a command pipe,
with its rendezvous store. The next call that the keeper lets take them runs in
them: one `HotCall` line on each command pipe, and each rank answers
"<exit code>" on its done pipe when the call is over ("<code> kept" when a
session's rank raised in user code and stays usable). When the keeper ends a
pool, its whole tree (workers, what they started, the store) is stopped here;
which pool a call takes and when one ends are the keeper's rules, not this
module's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from .. import protocol as p
from ..keeper import Keeper, World
from ..stopper import STOP_GRACE, Stopper
from .trees import live_trees


@dataclass(eq=False)
class Pool(World):
    """Hot ranks of one world: live workers, their command and done pipes, and their rendezvous store."""

    port: int = 0
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    cmd: dict[int, int] = field(default_factory=dict)  # rank -> write end of its command pipe
    done: dict[int, int] = field(default_factory=dict)  # rank -> read end of its done pipe
    buffers: dict[int, bytes] = field(default_factory=dict)
    store_pid: int | None = None

    @property
    def world_size(self) -> int:
        return int(self.shape)

    def fds(self) -> list[int]:
        return [*self.cmd.values(), *self.done.values()]

    def close_fds(self) -> None:
        for fd in self.fds():
            try:
                os.close(fd)
            except OSError:
                pass
        self.cmd.clear()
        self.done.clear()

    def send(self, rank: int, run_dir: str, env: dict[str, str]) -> None:
        """Tell one rank to run the next call from `run_dir` with `env`."""
        try:
            os.write(self.cmd[rank], p.encode(p.HotCall(run_dir, env)))  # a pipe buffer holds far more than one line
        except OSError:
            pass  # the rank is gone: its exit is reaped and reported

    def feed(self, rank: int, data: bytes) -> list[tuple[int, bool]]:
        """Bytes a rank wrote on its done pipe; (exit code, the rank stays usable) of each call it finished."""
        self.buffers[rank] = self.buffers.get(rank, b"") + data
        codes = []
        while b"\n" in self.buffers[rank]:
            line, self.buffers[rank] = self.buffers[rank].split(b"\n", 1)
            word, _, kept = line.partition(b" ")
            code = int(word or b"1")
            codes.append((code, code == 0 or kept == b"kept"))
        return codes

    def processes(self) -> list[psutil.Process]:
        """Every live process of the pool: its workers, what they started, its store."""
        return live_trees([*self.pids.values(), *([self.store_pid] if self.store_pid else [])])


class Pools(Keeper[Pool]):
    """The helper's kept worlds: the keeper's rules, ending a pool by stopping its process tree."""

    def __init__(self, on_session_end: Callable[[Pool, str], None] | None = None) -> None:
        super().__init__(self._stop, on_session_end)
        #: Stoppers of the pools being ended, carried on by `tick`.
        self.releasing: list[Stopper] = []

    def _stop(self, pools: list[Pool]) -> None:
        for pool in pools:
            pool.close_fds()  # each worker reads end-of-file on its command pipe and exits by itself
            stopper = Stopper(pool.processes, lambda pool=pool: list(pool.pids.values()), STOP_GRACE)  # type: ignore[misc]
            stopper.begin()
            self.releasing.append(stopper)

    @property
    def pools(self) -> list[Pool]:
        return self.worlds()

    def fds(self) -> list[int]:
        return [fd for pool in self.worlds() for fd in pool.fds()]

    def done_fds(self) -> dict[int, tuple[Pool, int]]:
        """Read end of every done pipe -> (its pool, its rank)."""
        return {fd: (pool, rank) for pool in self.worlds() for rank, fd in pool.done.items()}

    def store_pids(self) -> set[int]:
        return {q.store_pid for q in self.worlds() if q.store_pid is not None}

    def holding(self, pid: int) -> list[Pool]:
        """The pools `pid` is a worker of."""
        return [q for q in self.worlds() if pid in q.pids.values()]

    def tick(self) -> None:
        """Carry released pools' stops on, and end each pool idle for its keep_alive seconds."""
        for stopper in list(self.releasing):
            if list(stopper.find()):
                stopper.tick()
            else:
                self.releasing.remove(stopper)
        self.expire()
