"""The supervisor process: starts each job's workers, stops whole process trees, reports exits.

One per kernel, started by the local launcher (launcher.py) in its own session.
It reads requests on stdin and writes events on stdout, one JSON line each, as
defined in protocol.py. This module keeps the job table and the loop, the ends
of ranks and the stops; the rest of its work lives beside it:

- starts.py: a job's ranks started, in the pool the caller named or as new
  workers with their rendezvous store (the supervisor's base class).
- preload.py: with `--warm` it imports torch once, never initializes CUDA, and
  forks each worker from that state (milliseconds); the child takes the
  caller's environment, working directory and sys.path as they are at call
  time. A warm supervisor answers `stale` instead of forking when that state no
  longer matches the caller; the launcher then starts a fresh one. While idle it
  runs the `preload(env)` of the hook modules a call (or a PrepareHooks request)
  named (e.g. importing mlflow), hidden from a forked worker until its code imports
  it. A request that arrives meanwhile interrupts the preparation at its next
  import, so a call never waits for one its ranks do not need; a call whose code
  names what the preparation brings (mlflow) has it finished before its ranks are
  forked, once for them and every later call, instead of each rank importing it.
- spawn.py: forking and spawning workers and rendezvous stores. Without
  `--warm`, or for a job that asks for fresh interpreters, every worker is
  started by posix_spawn. The supervisor stays single-threaded so forking is
  safe: even the rendezvous store runs in a process of its own (rendezvous.py).
- pool.py: hot ranks by the pool id the caller's keeper chose (launch/keeper.py,
  in the process that makes calls, holds the rules: which call takes a pool, what
  a call leaves, when an idle one ends). A job that names a pool leaves its workers
  alive after the call; a later job naming it runs in them. On `EndPool`, and when
  the helper sees a pool end by itself (a dead rank or store, a stopped call,
  retirement, close), the pool's whole tree is stopped and `PoolEnded` says why.
- Ends: a rank that succeeded says on a pipe of its own, just before it exits, that
  its result is written; its RankExited goes out then, so the caller need not wait
  for the exit.
  JobGone still waits until every process of the job is gone.
- trees.py: it is a child subreaper, so processes a worker leaves behind are
  re-parented here and can still be found (by the AIR_MAGIC_JOB variable they
  inherit) and ended. End-of-file on stdin, or a new parent pid, means the
  kernel is gone: every job is stopped and the supervisor exits.

Policy (when to stop a job) belongs to the runner; this process carries it out.

Over 300 lines because the helper's single-threaded loop must see every job, pipe and child in one place to stay
fork-safe.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from typing import TYPE_CHECKING

from ...errors import describe_returncode
from .. import protocol as p
from ..come_back import Interrupt
from ..keeper import STOPPED, stopped
from ..stopper import STOP_GRACE, Stopper, become_subreaper
from .inbox import Inbox
from .jobs import Job
from .pool import Pool, Pools
from .preload import Preloaded, log_timing
from .spawn import Spawner
from .starts import Starts
from .starts import emit as _emit
from .trees import job_processes

if TYPE_CHECKING:
    import psutil

_TICK = 0.1


class Supervisor(Starts):
    """The job table and the loop of the supervisor process."""

    def __init__(self, warm: bool) -> None:
        self.jobs: dict[str, Job] = {}
        self.owner: dict[int, tuple[str, int]] = {}  # worker pid -> (job, rank)
        self.parent = os.getppid()
        self.closing = False
        self.retiring = False
        self.wake: tuple[int, int] | None = None
        started = time.monotonic()
        self.preloaded = Preloaded(warm)
        self.inbox = Inbox()
        if warm:
            log_timing(f"preloaded {', '.join(self.preloaded.modules) or 'nothing'}", time.monotonic() - started)
        self.warm = warm
        self.pools = Pools()
        self.done: dict[int, tuple[str, int]] = {}  # read end of a rank's done pipe -> (job, rank)
        self.done_buffers: dict[int, bytes] = {}
        self.spawner = Spawner(self.preloaded, lambda: (*(self.wake or ()), *self.pools.fds(), *self.done))

    # -- requests ----------------------------------------------------------
    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.LaunchJob):
            try:
                self.launch(msg)
            except Exception as exc:  # noqa: BLE001 - reported to the runner
                _emit(p.LaunchFailed(msg.job, f"{type(exc).__name__}: {exc}"))
                job = self.jobs.get(msg.job)
                if job is not None:
                    self.stop(job, 0.0)
                else:
                    _emit(p.JobGone(msg.job))
        elif isinstance(msg, p.Retire):
            self.retiring = True
            for pool in self.pools.pools:
                if not pool.call:
                    self.end_pool(pool, "the helper was replaced")
        elif isinstance(msg, p.EndPool):
            self.end_pool_asked(msg.pool, msg.why)
        elif isinstance(msg, p.PrepareHooks):
            if self.warm:
                self.preloaded.ask(msg.hooks, msg.env)
        elif isinstance(msg, p.StopJob):
            job = self.jobs.get(msg.job)
            if job is not None:
                if msg.interrupt_after is not None:
                    self.interrupt(job, msg.interrupt_after, msg.reason)
                else:
                    self.stop(job, msg.grace, stopped(msg.reason))
        elif isinstance(msg, p.DumpStacks):
            job = self.jobs.get(msg.job)
            if job is not None and job.stopper is None:
                from ..stacks import request_in_background

                # py-spy's native frames take up to NATIVE_LIMIT s: the loop (every call's events) goes on meanwhile
                request_in_background(job.live_workers, list(self.processes(job)))

    def read_done(self, pool: Pool, rank: int) -> None:
        """A hot rank wrote on its done pipe: "took" (a session call's SIGINT is now for it), or "<exit code>": its
        call is over, the process stays."""
        try:
            data = os.read(pool.done[rank], 4096)
        except OSError:
            data = b""
        if not data:
            os.close(pool.done.pop(rank))
            return  # it exited: reap() reports it
        took, ended = pool.feed(rank, data)
        job = self.jobs.get(pool.call)
        if took and job is not None:
            job.took.add(rank)  # its SIGINT is for this call from now on (interrupt_session)
        for code, usable in ended:
            if job is not None and rank not in job.exited:
                job.exited[rank] = code
                pool.spent = pool.spent or not usable  # its processes are no longer excluded from the job's
                self.report_exit(job, rank, code, usable)

    def read_said(self, fd: int) -> None:
        """A rank said on its done pipe that its outcome is written: report it now, while its process exits."""
        try:
            data = os.read(fd, 4096)
        except OSError:
            data = b""
        job_id, rank = self.done[fd]
        if not data:
            self.close_said(fd)
            return
        buffer = self.done_buffers.get(fd, b"") + data
        line, newline, self.done_buffers[fd] = buffer.partition(b"\n")
        job = self.jobs.get(job_id)
        if newline and job is not None and line.strip().lstrip(b"-").isdigit():
            self.report_exit(job, rank, int(line))

    def close_said(self, fd: int) -> None:
        self.done.pop(fd, None)
        self.done_buffers.pop(fd, None)
        os.close(fd)

    def report_exit(self, job: Job, rank: int, code: int, usable: bool | None = None) -> None:
        """RankExited, once per rank: when it says it is done, or when its exit is reaped, whichever is first.

        `usable`: a kept rank's process stays fit for the next call (the caller's keeper decides what it leaves)."""
        if rank not in job.reported:
            job.reported.add(rank)
            _emit(p.RankExited(job.id, rank, code, time.time(), usable=code == 0 if usable is None else usable))

    def end_pool(self, pool: Pool, why: str) -> None:
        """Stop `pool`'s process tree and say so (`PoolEnded`), once."""
        if self.pools.end(pool):
            _emit(p.PoolEnded(pool.id, why))

    def end_pool_asked(self, pool_id: str, why: str) -> None:
        """EndPool: the caller's keeper ended this pool; a job running in it is stopped with it."""
        pool = self.pools.get(pool_id)
        if pool is None:
            return
        job = self.jobs.get(pool.call)
        if job is not None:
            self.stop(job, STOP_GRACE, why)
        self.end_pool(pool, why)

    # -- process trees -----------------------------------------------------
    def processes(self, job: Job) -> dict[int, psutil.Process]:
        """Every live process of the job: workers, their descendants, and adopted orphans.

        While the job's hot ranks are kept, what they started and still own (torch.compile's compile workers,
        a DataLoader's persistent workers) stays with them: it ends when their pool does, not with the call.
        """
        known = set(self.owner) | {j.store_pid for j in self.jobs.values() if j.store_pid is not None}
        found = job_processes(job.id, job.live_workers, job.seen, job.started, known | self.pools.store_pids())
        if job.pool is not None and job.pool in self.pools.pools and not job.pool.spent:
            kept = {proc.pid for proc in job.pool.processes()}
            found = {pid: proc for pid, proc in found.items() if pid not in kept}
        return found

    def interrupt(self, job: Job, after: float, reason: str) -> None:
        """A session's call: ask its ranks to come back (`interrupt_session`) rather than stop them; any other: stop."""
        if job.pool is None or job.pool.session is None:
            self.stop(job, STOP_GRACE, stopped(reason))
        elif job.stopper is None and job.interrupt is None:
            job.interrupt = Interrupt(time.monotonic() + after, reason)

    def stop(self, job: Job, grace: float, why: str = STOPPED) -> None:
        """SIGTERM the job's whole tree now (each worker leads its own process group), SIGKILL after `grace`.

        `why` ends the job's session, if it has one. A stop after `interrupt` (a second Ctrl-C) stops at once.
        """
        if job.stopper is None:
            job.stopper = Stopper(lambda: self.processes(job).values(), lambda: job.live_workers, grace)
            job.stopper.begin()
            if job.pool is not None:  # a stopped call leaves no hot ranks: their state is unknown
                self.end_pool(job.pool, why)

    def interrupt_session(self, job: Job, interrupt: Interrupt) -> None:
        """KeyboardInterrupt in each rank of a session call still running, once it took the call (said "took": its
        SIGINT is then for the call, not lost); stacks and a stop for those that don't come back in time."""
        running = {rank: pid for rank, pid in job.pids.items() if rank not in job.exited}
        if not running:
            job.interrupt = None  # every rank is back in Python: the session is kept
            return
        now = time.monotonic()
        for rank in interrupt.send_to([r for r in running if r in job.took], now, in_code=True):
            try:
                os.kill(running[rank], signal.SIGINT)
            except OSError:
                pass
        late = interrupt.late(running, now)
        if late:
            from ..stacks import request

            request(list(running.values()), list(self.processes(job)))  # where they are stuck, into their logs
            self.stop(job, STOP_GRACE, interrupt.not_back(late))

    # -- the loop ----------------------------------------------------------
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            owner = self.owner.pop(pid, None)
            for pool in self.pools.holding(pid):  # a hot rank died (crash, OOM, kill): the rest of its world is no use
                rank = next(r for r, q in pool.pids.items() if q == pid)
                how = describe_returncode(os.waitstatus_to_exitcode(status))
                self.end_pool(pool, f"rank {rank} (pid {pid}) {how}")
            if owner is None:
                self.store_exited(pid, os.waitstatus_to_exitcode(status))
                continue  # the store, or an adopted orphan
            job = self.jobs.get(owner[0])
            if job is not None and owner[1] not in job.exited:
                code = os.waitstatus_to_exitcode(status)
                job.exited[owner[1]] = code
                self.report_exit(job, owner[1], code)

    def store_exited(self, pid: int, code: int) -> None:
        """A job's rendezvous store died under it: ranks would wait minutes for it, so stop the job and say why."""
        for pool in [q for q in self.pools.pools if q.store_pid == pid]:
            pool.store_pid = None
            self.end_pool(pool, "its rendezvous store died")
            if pool.call in self.jobs:
                self.jobs[pool.call].store_pid = pid  # reported below like any job's store
        for job in self.jobs.values():
            if job.store_pid == pid:
                job.store_pid = None
                if job.stopper is None:
                    how = describe_returncode(code)
                    _emit(
                        p.LaunchFailed(
                            job.id,
                            (
                                f"the job's rendezvous store (pid {pid}, 127.0.0.1:{job.port}) {how}, so the ranks "
                                "could not meet; every rank was stopped. Run the call again"
                            ),
                        )
                    )
                    self.stop(job, STOP_GRACE)

    def tick(self) -> None:
        self.pools.tick()
        for job in list(self.jobs.values()):
            if job.interrupt is not None and job.stopper is None:
                self.interrupt_session(job, job.interrupt)
            if job.stopper is not None:
                job.stopper.tick()
            if len(job.exited) < len(job.pids) or (len(job.pids) < job.world_size and job.stopper is None):
                continue
            if job.store_pid is not None:
                try:
                    os.kill(job.store_pid, signal.SIGKILL)
                except OSError:
                    pass
                job.store_pid = None
            leftovers = self.processes(job)
            if leftovers and job.stopper is None:
                self.stop(job, STOP_GRACE)  # a finished job's stray children get TERM, then KILL
                continue
            if not leftovers:
                del self.jobs[job.id]
                for fd in [fd for fd, (owner, _) in self.done.items() if owner == job.id]:
                    self.close_said(fd)  # a rank's own children may still hold its write end
                if job.pool is not None and job.pool in self.pools.pools:
                    job.pool.call = ""  # ready for the next call that names it
                    for rank, pid in job.pool.pids.items():
                        self.owner[pid] = ("", rank)
                _emit(p.JobGone(job.id))

    def run(self) -> None:
        import gc

        # What was preloaded (torch: hundreds of thousands of objects) is never garbage: keep it out of every
        # collection in the workers forked from here, which also keeps its memory pages shared with them.
        gc.freeze()
        become_subreaper()
        self.wake = os.pipe()
        rfd, wfd = self.wake
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self.close())
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while not ((self.closing or self.retiring) and not self.jobs and not self.pools.releasing):
            done = self.pools.done_fds()
            said = list(self.done)
            ready, _, _ = select.select([*([0] if not self.closing else []), rfd, *done, *said], [], [], _TICK)
            for fd in ready:
                if fd in done:
                    self.read_done(*done[fd])
                elif fd in said:
                    self.read_said(fd)
            if rfd in ready:
                os.read(rfd, 4096)
            if 0 in ready:
                self.inbox.read()
            while (msg := self.inbox.next()) is not None:
                self.handle(msg)
            if self.inbox.eof or os.getppid() != self.parent:
                self.close()
            self.reap()
            self.tick()
            idle = not (self.jobs or self.closing or self.retiring or self.inbox.readable())
            if self.preloaded.pending and idle:
                # Nothing to watch, no request waiting; one that comes meanwhile may interrupt the preparation.
                self.preloaded.run_preparations(self.must_give_way)

    def must_give_way(self, preparing: str) -> bool:
        """Asked by a background preparation at each module it loads (see inbox.py)."""
        return self.inbox.must_give_way(preparing, self.handle, self.preloaded.needed_by)

    def close(self) -> None:
        """The kernel is gone or asked us to go: stop every job, then leave."""
        if not self.closing:
            print(
                f"air_magic supervisor {os.getpid()}: closing, stopping {len(self.jobs)} job(s)",
                file=sys.stderr,
                flush=True,
            )
        self.closing = True
        for job in self.jobs.values():
            self.stop(job, STOP_GRACE)
        for pool in self.pools.pools:
            self.end_pool(pool, "the kernel shut down")


def main() -> None:
    import faulthandler

    faulthandler.enable()  # a crash of the supervisor itself leaves a trace in its log
    Supervisor(warm="--warm" in sys.argv[1:]).run()
