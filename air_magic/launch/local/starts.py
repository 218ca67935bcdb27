"""How the helper starts a job's ranks: in the kept pool the job names (chosen by the caller's keeper), or as new
workers, forked from the warm state or spawned, with the job's rendezvous store; and how it says what happened.

`Starts` is the supervisor's base class (supervisor.py): it acts on the job table the supervisor keeps and declares
here. Not for the loop, the ends of ranks or stopping a job (supervisor.py), nor for forking and spawning itself
(spawn.py) or the rules of kept worlds (launch/keeper.py, in the caller's process).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

from ...envvars import HOT_FDS, JOB, SUPERVISOR_PID
from .. import protocol as p
from ..env import loopback_sockets, torchrun_env
from ..files.rundir import RunDir
from .jobs import Job
from .pool import Pool, Pools
from .preload import Preloaded
from .spawn import Spawner


def emit(event: p.Event) -> None:
    """Say `event` to the launcher: one JSON line on stdout."""
    try:
        os.write(1, p.encode(event))
    except BrokenPipeError:
        pass  # the kernel is gone; stdin EOF follows and stops everything


class Starts:
    """The starting half of the helper: a job's ranks, new or kept from an earlier call."""

    jobs: dict[str, Job]
    owner: dict[int, tuple[str, int]]
    done: dict[int, tuple[str, int]]
    warm: bool
    preloaded: Preloaded
    pools: Pools
    spawner: Spawner

    def launch(self, msg: p.LaunchJob) -> None:
        in_session = msg.session is not None and self.pools.get(msg.pool) is not None
        if msg.fork and self.warm and not in_session:  # a session's live ranks are what they are
            reason = self.preloaded.stale_reason(msg)
            if reason is not None:
                emit(p.Stale(msg.job, reason))
                return
            self.preloaded.ask(msg.hooks, msg.env)
        job = Job(msg.job, msg.world_size)
        self.jobs[job.id] = job
        hot = msg.pool is not None and msg.fork
        if not (hot and self.run_hot(job, msg)):
            self.start_workers(job, msg, hot)

    def start_workers(self, job: Job, msg: p.LaunchJob, hot: bool) -> None:
        """New workers for `job` (and its rendezvous store); with `hot`, they become the pool `msg.pool` that outlives
        the call."""
        if msg.fork and self.warm:
            needed = self.preloaded.needed_by(RunDir(Path(msg.run_dir)).payload)
            if needed:  # the ranks import what these bring: once here, to the end, rather than in every rank
                self.preloaded.run_preparations(only=needed)
        env = dict(msg.env)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = job.port = sock.getsockname()[1]
        env.update({JOB: job.id, SUPERVISOR_PID: str(os.getpid())})
        store = importlib.util.find_spec("torch") is not None
        if store:
            sock.listen(max(128, 4 * job.world_size))
            job.store_pid = self.spawner.store(msg, env, sock, port)
        sock.close()
        loopback_sockets(env)
        pool = None
        if hot:
            pool = job.pool = Pool(str(msg.pool), job.world_size, msg.session, call=job.id, port=port)
            pool.store_pid, job.store_pid = job.store_pid, None  # the store lives as long as the pool
            self.pools.add(pool)
            pipes = {rank: (os.pipe(), os.pipe()) for rank in range(job.world_size)}
        for rank in range(job.world_size):
            rank_env = _rank_env(env, msg, rank, port, agent_store=store)
            log = str(RunDir(Path(msg.run_dir)).log(rank))
            if pool is not None:  # a hot rank reports each call's end on its pool's done pipe
                (cmd_r, cmd_w), (done_r, done_w) = pipes[rank]
                rank_env[HOT_FDS] = f"{cmd_r},{done_w}"
                close = [cmd_w, done_r, *(fd for r, pair in pipes.items() for fd in (*pair[0], *pair[1]) if r != rank)]
                said = None
            else:  # any other says once, just before it exits, that its outcome is written
                done_r, done_w = os.pipe()
                close, said = [done_r], done_w
            pid = self.spawner.worker(msg, rank, rank_env, log, close=close, done=said)
            os.close(done_w)
            if pool is not None:
                os.close(cmd_r)
                pool.cmd[rank], pool.done[rank], pool.pids[rank] = cmd_w, done_r, pid
            else:
                self.done[done_r] = (job.id, rank)
            job.pids[rank] = pid
            self.owner[pid] = (job.id, rank)
            emit(p.RankStarted(job.id, rank, pid))

    def run_hot(self, job: Job, msg: p.LaunchJob) -> bool:
        """Run `job` in the pool it names, if this helper holds it (a replaced helper does not); True if it did."""
        pool = self.pools.get(msg.pool)
        if pool is None:
            return False
        if pool.call or pool.world_size != job.world_size:
            raise RuntimeError(f"the helper's pool {pool.id} is not free for a call of {job.world_size} rank(s)")
        pool.call = job.id
        job.pool, job.port = pool, pool.port
        env = {**msg.env, JOB: job.id, SUPERVISOR_PID: str(os.getpid())}
        loopback_sockets(env)
        for rank, pid in pool.pids.items():
            rank_env = _rank_env(env, msg, rank, pool.port)
            rank_env[HOT_FDS] = os.environ.get(HOT_FDS, "")
            job.pids[rank] = pid
            self.owner[pid] = (job.id, rank)
            pool.send(rank, msg.run_dir, rank_env)
            emit(p.RankStarted(job.id, rank, pid))
        return True


def _rank_env(env: dict[str, str], msg: p.LaunchJob, rank: int, port: int, agent_store: bool = True) -> dict[str, str]:
    """`env` plus the torchrun variables of `rank` in the job `msg` starts (every rank on this machine)."""
    return dict(
        env,
        **torchrun_env(
            rank=rank,
            world_size=msg.world_size,
            local_rank=rank,
            local_world_size=msg.world_size,
            master_port=port,
            run_id=Path(msg.run_dir).name,  # the call's: the same for each of its restarts
            agent_store=agent_store,
            restart_count=msg.restart_count,
            max_restarts=msg.max_restarts,
        ),
    )
