"""Hot ranks in the helper: the processes and pipes of kept worlds, by the id the caller's keeper gave each.

A call with `keep_alive` leaves its workers alive, each waiting on a command pipe,
with its rendezvous store. A `LaunchJob` that names the pool runs in them: one
`HotCall` line on each command pipe, and each rank answers "<exit code>" on its
done pipe when the call is over ("<code> kept" when a session's rank raised in
user code and stays usable). A session's rank first says "took" as the user's
code starts (the supervisor interrupts no rank before). When a pool ends (`EndPool`, or what the helper
sees: a dead rank or store, a stopped call, retirement), its whole tree
(workers, what they started, the store) is stopped here. Which pool a call takes,
what a call leaves and when an idle pool ends are the rules of the caller's
keeper (launch/keeper.py), not this module's: `Pools` is a plain table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import psutil

from .. import protocol as p
from ..stopper import STOP_GRACE, Stopper
from .trees import live_trees


@dataclass(eq=False)
class Pool:
    """Hot ranks of one world: live workers, their command and done pipes, and their rendezvous store."""

    #: The id the caller's keeper chose (LaunchJob.pool).
    id: str
    world_size: int
    #: The session whose ranks these are, if any (a stop first asks them to come back).
    session: str | None = None
    #: The job running in it now, or "" while it waits.
    call: str = ""
    #: A rank said its process is no longer usable: the pool ends with its call (the keeper has said so too).
    spent: bool = False
    port: int = 0
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    cmd: dict[int, int] = field(default_factory=dict)  # rank -> write end of its command pipe
    done: dict[int, int] = field(default_factory=dict)  # rank -> read end of its done pipe
    buffers: dict[int, bytes] = field(default_factory=dict)
    store_pid: int | None = None

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

    def feed(self, rank: int, data: bytes) -> tuple[bool, list[tuple[int, bool]]]:
        """Bytes a rank wrote on its done pipe: whether it said it took a session call ("took"), and (exit code, the
        rank stays usable) of each call it finished."""
        self.buffers[rank] = self.buffers.get(rank, b"") + data
        took, codes = False, []
        while b"\n" in self.buffers[rank]:
            line, self.buffers[rank] = self.buffers[rank].split(b"\n", 1)
            if line == p.TOOK:
                took = True
                continue
            word, _, kept = line.partition(b" ")
            code = int(word or b"1")
            codes.append((code, code == 0 or kept == b"kept"))
        return took, codes

    def processes(self) -> list[psutil.Process]:
        """Every live process of the pool: its workers, what they started, its store."""
        return live_trees([*self.pids.values(), *([self.store_pid] if self.store_pid else [])])


class Pools:
    """The helper's pools by id; ending one stops its process tree. No rules: the caller's keeper decides."""

    def __init__(self) -> None:
        self.by_id: dict[str, Pool] = {}
        #: Stoppers of the pools being ended, carried on by `tick`.
        self.releasing: list[Stopper] = []

    def add(self, pool: Pool) -> None:
        self.by_id[pool.id] = pool

    def get(self, pool_id: str | None) -> Pool | None:
        return self.by_id.get(pool_id) if pool_id is not None else None

    def end(self, pool: Pool) -> bool:
        """Stop `pool`'s process tree; False if it was not held (ended already)."""
        if self.by_id.get(pool.id) is not pool:
            return False
        del self.by_id[pool.id]
        pool.close_fds()  # each worker reads end-of-file on its command pipe and exits by itself
        stopper = Stopper(pool.processes, lambda: list(pool.pids.values()), STOP_GRACE)
        stopper.begin()
        self.releasing.append(stopper)
        return True

    @property
    def pools(self) -> list[Pool]:
        return list(self.by_id.values())

    def fds(self) -> list[int]:
        return [fd for pool in self.pools for fd in pool.fds()]

    def done_fds(self) -> dict[int, tuple[Pool, int]]:
        """Read end of every done pipe -> (its pool, its rank)."""
        return {fd: (pool, rank) for pool in self.pools for rank, fd in pool.done.items()}

    def store_pids(self) -> set[int]:
        return {q.store_pid for q in self.pools if q.store_pid is not None}

    def holding(self, pid: int) -> list[Pool]:
        """The pools `pid` is a worker of."""
        return [q for q in self.pools if pid in q.pids.values()]

    def tick(self) -> None:
        """Carry ended pools' stops on."""
        for stopper in list(self.releasing):
            if list(stopper.find()):
                stopper.tick()
            else:
                self.releasing.remove(stopper)
