"""The supervisor process: starts each job's workers, stops whole process trees, reports exits.

One per kernel, started by the local launcher (local.py) in its own session.
It reads requests on stdin and writes events on stdout, one JSON line each,
as defined in protocol.py.

- Warm start: with `--warm` it imports torch once, never initializes CUDA,
  and forks each worker from that state (fork speed, milliseconds), then the
  child takes the caller's environment, working directory and sys.path as
  they are at call time. Without it, or for a job that asks for `spawn`,
  every worker is a fresh interpreter (posix_spawn). The supervisor stays
  single-threaded so forking is safe: even the rendezvous store runs in a
  process of its own (rendezvous.py).
- Staleness: a warm supervisor answers `stale` instead of forking when the
  interpreter differs, a preloaded module's file changed on disk, the caller's
  sys.path would import another copy of a preloaded package, or an
  environment variable read at import time differs; the runner then starts a
  fresh supervisor.
- Hot ranks: a job with `keep_alive` leaves its workers alive after the call,
  each waiting on a command pipe, with its rendezvous store; the next job of
  the same world runs in them (a line on each pipe names its run directory and
  environment) and each reports "done <code>" on its own pipe instead of
  exiting. Idle past `keep_alive`, after a failure or a stop, on ReleaseHot,
  retirement or close, the pool's whole tree is stopped.
- Clean-up: it is a child subreaper, so processes a worker leaves behind are
  re-parented here and can still be found (by the AIR_MAGIC_JOB variable they
  inherit) and ended. End-of-file on stdin, or a new parent pid, means the
  kernel is gone: every job is stopped and the supervisor exits.

Policy (when to stop a job) belongs to the runner; this process carries it out.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import random
import select
import signal
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from . import protocol as p
from .rundir import RunDir
from .stopper import STOP_GRACE, Stopper, become_subreaper

_WORKER_BOOT = "import sys; sys.path.insert(0, {parent!r}); from air_magic.launch.worker import main; main()"
_STORE_BOOT = "import sys; sys.path.insert(0, {parent!r}); from air_magic.launch.rendezvous import main; main()"
_TICK = 0.1
#: Variables read when torch is imported: a warm supervisor with other values is stale.
IMPORT_TIME_ENV = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONHASHSEED", "TORCH_HOME", "PYTORCH_NVML_BASED_CUDA_CHECK")
#: Modules a warm supervisor imports up front; AIR_MAGIC_PRELOAD (comma-separated) replaces the list.
PRELOAD = ("torch", "torch.distributed", "numpy")


@dataclass
class Job:
    """One call's workers as the supervisor tracks them."""

    id: str
    world_size: int
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    exited: dict[int, int] = field(default_factory=dict)  # rank -> return code
    stopper: Stopper | None = None
    pool: Pool | None = None
    store_pid: int | None = None
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    port: int = 0

    @property
    def live_workers(self) -> list[int]:
        return [pid for rank, pid in self.pids.items() if rank not in self.exited]


@dataclass
class Pool:
    """Hot ranks: live workers of one world, their command and done pipes, and their rendezvous store."""

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


def _emit(event: p.Event) -> None:
    try:
        os.write(1, p.encode(event))
    except BrokenPipeError:
        pass  # the kernel is gone; stdin EOF follows and stops everything


class Preloaded:
    """What a warm supervisor imported, and how to tell that it no longer matches the caller."""

    def __init__(self, warm: bool) -> None:
        self.modules: dict[str, str] = {}
        self.files: dict[str, int] = {}
        self.env = {k: os.environ.get(k) for k in IMPORT_TIME_ENV}
        if not warm:
            return
        wanted = os.environ.get("AIR_MAGIC_PRELOAD")
        for name in [n.strip() for n in wanted.split(",") if n.strip()] if wanted is not None else PRELOAD:
            if importlib.util.find_spec(name.split(".")[0]) is None:
                continue
            module = __import__(name)
            self.modules[name.split(".")[0]] = os.path.dirname(getattr(module, "__file__", "") or "")
        stdlib = sysconfig.get_paths()["stdlib"]
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if path and not path.startswith(stdlib):
                try:
                    self.files[path] = os.stat(path).st_mtime_ns
                except OSError:
                    pass

    def stale_reason(self, msg: p.LaunchJob) -> str | None:
        if msg.executable != sys.executable:
            return f"the interpreter is now {msg.executable}"
        env = msg.env
        for key, value in self.env.items():
            if env.get(key) != value:
                return f"{key} changed"
        for top, where in self.modules.items():
            spec = importlib.machinery.PathFinder.find_spec(top, msg.sys_path)
            if spec is not None and spec.origin and os.path.dirname(spec.origin) != where:
                return f"sys.path now finds {top} at {spec.origin}"
        for path, mtime in self.files.items():
            try:
                if os.stat(path).st_mtime_ns != mtime:
                    return f"{path} changed on disk"
            except OSError:
                return f"{path} is gone"
        return None


class Supervisor:
    def __init__(self, warm: bool) -> None:
        self.jobs: dict[str, Job] = {}
        self.owner: dict[int, tuple[str, int]] = {}  # worker pid -> (job, rank)
        self.parent = os.getppid()
        self.closing = False
        self.retiring = False
        self.wake: tuple[int, int] | None = None
        self.preloaded = Preloaded(warm)
        self.warm = warm
        self.pools: list[Pool] = []
        self.releasing: list[Stopper] = []

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
            self.release_idle()
        elif isinstance(msg, p.ReleaseHot):
            self.release_idle()
        elif isinstance(msg, p.StopJob):
            job = self.jobs.get(msg.job)
            if job is not None:
                self.stop(job, msg.grace)

    def launch(self, msg: p.LaunchJob) -> None:
        fork = msg.fork
        if fork and self.warm:
            reason = self.preloaded.stale_reason(msg)
            if reason is not None:
                _emit(p.Stale(msg.job, reason))
                return
        job = Job(msg.job, msg.world_size)
        self.jobs[job.id] = job
        hot = bool(msg.keep_alive) and fork
        if hot and self.run_hot(job, msg):
            return
        env = dict(msg.env)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = job.port = sock.getsockname()[1]
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(job.world_size),
            LOCAL_WORLD_SIZE=str(job.world_size), NODE_RANK="0", GROUP_RANK="0",
            AIR_MAGIC_JOB=job.id, AIR_MAGIC_SUPERVISOR_PID=str(os.getpid()),
        )
        if importlib.util.find_spec("torch") is not None:
            sock.listen(max(128, 4 * job.world_size))
            job.store_pid = self.start_store(msg, env, sock, port, job.world_size, fork)
            env.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        sock.close()
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        pool = None
        if hot:
            pool = job.pool = Pool(msg.world_key, job.world_size, float(msg.keep_alive or 0), port, job=job.id)
            pool.store_pid, job.store_pid = job.store_pid, None  # the store lives as long as the pool
            self.pools.append(pool)
            pipes = {rank: (os.pipe(), os.pipe()) for rank in range(job.world_size)}
        for rank in range(job.world_size):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            log = str(RunDir(Path(msg.run_dir)).log(rank))
            if pool is not None:
                (cmd_r, cmd_w), (done_r, done_w) = pipes[rank]
                rank_env["AIR_MAGIC_HOT_FDS"] = f"{cmd_r},{done_w}"
                others = [fd for r, pair in pipes.items() for fd in (*pair[0], *pair[1]) if r != rank]
                pid = self.fork_worker(msg.run_dir, rank, rank_env, log, close=[cmd_w, done_r, *others])
                os.close(cmd_r)
                os.close(done_w)
                pool.cmd[rank], pool.done[rank], pool.pids[rank] = cmd_w, done_r, pid
            elif fork:
                pid = self.fork_worker(msg.run_dir, rank, rank_env, log)
            else:
                pid = os.posix_spawn(
                    msg.executable,
                    [msg.executable, "-c", _WORKER_BOOT.format(parent=msg.package_parent), msg.run_dir, str(rank)],
                    rank_env,
                    file_actions=[
                        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                        (os.POSIX_SPAWN_OPEN, 1, log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
                        (os.POSIX_SPAWN_DUP2, 1, 2),
                    ],
                    setsid=True,
                    setsigdef=(signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD),
                )
            job.pids[rank] = pid
            self.owner[pid] = (job.id, rank)
            _emit(p.RankStarted(job.id, rank, pid))

    def start_store(self, msg: p.LaunchJob, env: dict[str, str], sock: socket.socket, port: int, n: int, fork: bool) -> int:
        """A process serving the job's TCPStore on `sock` (forked when warm, else spawned)."""
        if fork and "torch" in sys.modules:
            pid = self._fork_child(lambda: self._serve_store_here(sock.fileno(), port, n), env=env, log=None)
            return pid
        return os.posix_spawn(
            msg.executable,
            [msg.executable, "-c", _STORE_BOOT.format(parent=msg.package_parent), str(port), str(n)],
            env,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, sock.fileno(), 3),
            ],
            setsid=True,
            setsigdef=(signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD),
        )

    @staticmethod
    def _serve_store_here(fd: int, port: int, n: int) -> int:
        from .rendezvous import serve

        serve(fd, port, n)
        return 0

    def run_hot(self, job: Job, msg: p.LaunchJob) -> bool:
        """Run `job` in an idle pool of the same world, if there is one; True if it did."""
        pool = next((q for q in self.pools if q.job is None and q.key == msg.world_key), None)
        if pool is None or pool.world_size != job.world_size:
            return False
        pool.job, pool.idle_since, job.pool, job.port = job.id, None, pool, pool.port
        env = dict(msg.env)
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pool.port), WORLD_SIZE=str(job.world_size),
            LOCAL_WORLD_SIZE=str(job.world_size), NODE_RANK="0", GROUP_RANK="0", AIR_MAGIC_JOB=job.id,
            AIR_MAGIC_SUPERVISOR_PID=str(os.getpid()), TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT="0",
        )
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        for rank, pid in pool.pids.items():
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            rank_env["AIR_MAGIC_HOT_FDS"] = os.environ.get("AIR_MAGIC_HOT_FDS", "")
            line = json.dumps({"run_dir": msg.run_dir, "env": rank_env}).encode() + b"\n"
            job.pids[rank] = pid
            self.owner[pid] = (job.id, rank)
            try:
                os.write(pool.cmd[rank], line)  # a pipe buffer holds far more than one line: this never blocks long
            except OSError:
                pass  # the rank is gone: its exit is reaped and reported
            _emit(p.RankStarted(job.id, rank, pid))
        return True

    def read_done(self, pool: Pool, rank: int) -> None:
        """A hot rank wrote "<exit code>" on its done pipe: its call is over, the process stays."""
        try:
            data = os.read(pool.done[rank], 4096)
        except OSError:
            data = b""
        if not data:
            os.close(pool.done.pop(rank))
            return  # it exited: reap() reports it
        pool.buffers[rank] = pool.buffers.get(rank, b"") + data
        while b"\n" in pool.buffers[rank]:
            line, pool.buffers[rank] = pool.buffers[rank].split(b"\n", 1)
            job = self.jobs.get(pool.job or "")
            if job is not None and rank not in job.exited:
                code = int(line or b"1")
                job.exited[rank] = code
                _emit(p.RankExited(job.id, rank, code, time.time()))
                if code != 0:
                    self.release(pool)  # a rank that failed is not reused: the next call gets fresh ranks

    def pool_processes(self, pool: Pool) -> list[psutil.Process]:
        found: list[psutil.Process] = []
        for pid in [*pool.pids.values(), *([pool.store_pid] if pool.store_pid else [])]:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found += [proc, *proc.children(recursive=True)]
            except psutil.Error:
                pass
        return found

    def release(self, pool: Pool) -> None:
        """End a pool's whole tree (workers, what they started, its store): SIGTERM, grace, SIGKILL."""
        if pool not in self.pools:
            return
        self.pools.remove(pool)
        pool.close_fds()  # each worker reads end-of-file on its command pipe and exits by itself
        stopper = Stopper(lambda: self.pool_processes(pool), lambda: list(pool.pids.values()), STOP_GRACE)
        stopper.begin()
        self.releasing.append(stopper)

    def release_idle(self) -> None:
        for pool in [q for q in self.pools if q.job is None]:
            self.release(pool)

    def fork_worker(self, run_dir: str, rank: int, env: dict[str, str], log: str, close: list[int] = ()) -> int:  # type: ignore[assignment]
        def body() -> int:
            from .worker import run_forked

            for fd in close:
                try:
                    os.close(fd)
                except OSError:
                    pass  # already closed with the pools' ends
            _reset_inherited_state(env)
            run_forked(Path(run_dir), rank)  # ends the process
            return 70

        return self._fork_child(body, env=env, log=log)

    def _fork_child(self, body: Any, env: dict[str, str], log: str | None) -> int:
        pid = os.fork()
        if pid:
            return pid
        code = 70
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(out, 1)
            os.dup2(out, 2)
            for fd in (null, out, *(self.wake or ()), *(fd for pool in self.pools for fd in pool.fds())):
                os.close(fd)  # no child holds another's pipes: a hot rank sees end-of-file when its pool goes
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.environ.clear()
            os.environ.update(env)
            code = body()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - a broken fork must never return into the supervisor
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)

    # -- process trees -----------------------------------------------------
    def processes(self, job: Job) -> dict[int, psutil.Process]:
        """Every live process of the job: workers, their descendants, and adopted orphans."""
        found: dict[int, psutil.Process] = {}
        for pid in job.live_workers:
            try:
                p = psutil.Process(pid)
                found[pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
            except psutil.Error:
                pass
        try:
            mine = psutil.Process().children(recursive=True)
        except psutil.Error:
            mine = []
        me = os.getpid()
        known = set(self.owner) | {j.store_pid for j in self.jobs.values() if j.store_pid is not None}
        known |= {q.store_pid for q in self.pools if q.store_pid is not None}
        for c in mine:
            if c.pid in found or c.pid in known:
                continue
            try:
                tag = c.environ().get("AIR_MAGIC_JOB")
                if tag == job.id or c.pid in job.seen:
                    found[c.pid] = c
                elif tag is None and c.ppid() == me and c.create_time() >= job.started - 1:
                    # An orphan we adopted that carries no job tag: it dropped its environment (env={}), or
                    # it was forked from a warm worker, whose /proc environ is ours. Only a job running
                    # when it was born can have started it, so each such job counts it as its own.
                    found[c.pid] = c
                    found.update((d.pid, d) for d in c.children(recursive=True))
            except psutil.Error:
                pass
        for pid, p in list(found.items()):
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    del found[pid]
            except psutil.Error:
                del found[pid]
        job.seen.update(found)
        return found

    def stop(self, job: Job, grace: float) -> None:
        """SIGTERM the job's whole tree now (each worker leads its own process group), SIGKILL after `grace`."""
        if job.stopper is None:
            job.stopper = Stopper(lambda: self.processes(job).values(), lambda: job.live_workers, grace)
            job.stopper.begin()
            if job.pool is not None:
                self.release(job.pool)  # a stopped call leaves no hot ranks: their state is unknown

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
            for pool in [q for q in self.pools if pid in q.pids.values()]:
                self.release(pool)  # a hot rank died (crash, OOM, kill): the rest of its world is no use
            if owner is None:
                self.store_exited(pid, os.waitstatus_to_exitcode(status))
                continue  # the store, or an adopted orphan
            job = self.jobs.get(owner[0])
            if job is not None and owner[1] not in job.exited:
                code = os.waitstatus_to_exitcode(status)
                job.exited[owner[1]] = code
                _emit(p.RankExited(job.id, owner[1], code, time.time()))

    def store_exited(self, pid: int, code: int) -> None:
        """A job's rendezvous store died under it: ranks would wait minutes for it, so stop the job and say why."""
        for pool in [q for q in self.pools if q.store_pid == pid]:
            pool.store_pid = None
            self.release(pool)
            if pool.job in self.jobs:
                self.jobs[pool.job].store_pid = pid  # reported below like any job's store
        for job in self.jobs.values():
            if job.store_pid == pid:
                job.store_pid = None
                if job.stopper is None:
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    _emit(p.LaunchFailed(job.id, (
                        f"the job's rendezvous store (pid {pid}, 127.0.0.1:{job.port}) {how}, so the ranks could "
                        "not meet; every rank was stopped. Run the call again")))
                    self.stop(job, STOP_GRACE)

    def tick(self) -> None:
        now = time.monotonic()
        for stopper in list(self.releasing):
            if list(stopper.find()):
                stopper.tick()
            else:
                self.releasing.remove(stopper)
        for pool in [q for q in self.pools if q.job is None]:
            if now - (pool.idle_since or now) >= pool.keep_alive:
                self.release(pool)  # idle for keep_alive seconds: free its memory
        for job in list(self.jobs.values()):
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
                if job.pool is not None and job.pool in self.pools:
                    job.pool.job, job.pool.idle_since = None, time.monotonic()  # ready for the next call
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
        _emit(p.Ready(os.getpid(), sorted(self.preloaded.modules)))
        buf = b""
        while not ((self.closing or self.retiring) and not self.jobs and not self.releasing):
            done = {fd: (pool, rank) for pool in self.pools for rank, fd in pool.done.items()}
            ready, _, _ = select.select([*([0] if not self.closing else []), rfd, *done], [], [], _TICK)
            for fd in ready:
                if fd in done:
                    self.read_done(*done[fd])
            if rfd in ready:
                os.read(rfd, 4096)
            if 0 in ready:
                chunk = os.read(0, 65536)
                if not chunk:
                    self.close()
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        self.handle(p.decode(line))
            if os.getppid() != self.parent:
                self.close()
            self.reap()
            self.tick()

    def close(self) -> None:
        """The kernel is gone or asked us to go: stop every job, then leave."""
        if not self.closing:
            print(f"air_magic supervisor {os.getpid()}: closing, stopping {len(self.jobs)} job(s)", file=sys.stderr, flush=True)
        self.closing = True
        for job in self.jobs.values():
            self.stop(job, STOP_GRACE)
        for pool in list(self.pools):
            self.release(pool)


def _reset_inherited_state(env: dict[str, str]) -> None:
    """In a forked worker: give it what a fresh interpreter would have had."""
    random.seed()  # a fresh interpreter seeds from the OS; forks would share one stream
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # fresh interpreters draw a random initial seed too
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # OpenMP read the supervisor's value at import


def main() -> None:
    import faulthandler

    faulthandler.enable()  # a crash of the supervisor itself leaves a trace in its log
    Supervisor(warm="--warm" in sys.argv[1:]).run()
