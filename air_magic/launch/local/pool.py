"""Hot ranks: workers kept alive between calls of the same world, and when they are let go.

A call with `keep_alive` leaves its workers alive, each waiting on a command pipe,
with its rendezvous store. The next call of the same world (same `world_key` and
size) runs in them: one `HotCall` line on each command pipe, and each rank answers
"<exit code>" on its done pipe when the call is over. A pool idle past its
`keep_alive`, one whose rank failed or died, and every idle pool on release is
stopped as a whole tree (workers, what they started, the store).

A session (launch/session.py) is a pool found by its name rather than its world: a
call of that session runs in it whatever its environment, and a call that raised in
user code leaves it usable ("<code> kept" on the done pipe). When a session's pool
ends, `Pools.on_session_end` is told why, once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from .. import protocol as p
from ..stopper import STOP_GRACE, Stopper
from .trees import live_trees


@dataclass
class Pool:
    """Hot ranks of one world: live workers, their command and done pipes, and their rendezvous store."""

    key: str
    world_size: int
    keep_alive: float
    port: int
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    cmd: dict[int, int] = field(default_factory=dict)  # rank -> write end of its command pipe
    done: dict[int, int] = field(default_factory=dict)  # rank -> read end of its done pipe
    buffers: dict[int, bytes] = field(default_factory=dict)
    store_pid: int | None = None
    job: str | None = None  # the job running in it now
    idle_since: float | None = None
    #: The session these ranks hold, if any.
    session: str | None = None

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

    def call(self, rank: int, run_dir: str, env: dict[str, str]) -> None:
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


class Pools:
    """The supervisor's hot pools, and the stoppers of those being released."""

    def __init__(self, on_session_end: Callable[[Pool, str], None] | None = None) -> None:
        self.pools: list[Pool] = []
        self.releasing: list[Stopper] = []
        #: Told (pool, why) when a session's pool is released.
        self.on_session_end = on_session_end

    def add(self, pool: Pool) -> None:
        self.pools.append(pool)

    def idle(self, key: str, world_size: int) -> Pool | None:
        """An idle pool of world `key` with `world_size` ranks that holds no session, if there is one."""
        pool = next((q for q in self.pools if q.job is None and q.key == key and q.session is None), None)
        return pool if pool is not None and pool.world_size == world_size else None

    def session(self, name: str) -> Pool | None:
        """The pool that holds session `name`, if it is alive."""
        return next((q for q in self.pools if q.session == name), None)

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

    def release(self, pool: Pool, why: str = "its ranks were released") -> None:
        """End a pool's whole tree (workers, what they started, its store): SIGTERM, grace, SIGKILL."""
        if pool not in self.pools:
            return
        self.pools.remove(pool)
        if pool.session is not None and self.on_session_end is not None:
            self.on_session_end(pool, why)
        pool.close_fds()  # each worker reads end-of-file on its command pipe and exits by itself
        stopper = Stopper(pool.processes, lambda: list(pool.pids.values()), STOP_GRACE)
        stopper.begin()
        self.releasing.append(stopper)

    def release_idle(self, why: str = "its ranks were released") -> None:
        for pool in [q for q in self.pools if q.job is None]:
            self.release(pool, why)

    def tick(self, now: float | None = None) -> None:
        """Carry released pools' stops on, and release each pool idle for its keep_alive seconds (`now`: monotonic)."""
        now = time.monotonic() if now is None else now
        for stopper in list(self.releasing):
            if list(stopper.find()):
                stopper.tick()
            else:
                self.releasing.remove(stopper)
        for pool in [q for q in self.pools if q.job is None]:
            if now - (pool.idle_since or now) >= pool.keep_alive:
                self.release(pool, f"idle for {pool.keep_alive:g} s (its keep-alive)")  # free its memory
