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
- Warm-ups: a call may name modules (AIR_MAGIC_WARM_UP) whose `warm_up(env)`
  the supervisor runs while idle after it, e.g. importing mlflow; what they
  import stays out of a forked worker's sys.modules until its code imports
  it (see `Preloaded`).
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

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
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

from ..errors import describe_returncode
from . import protocol as p
from .env import loopback_sockets, torchrun_env
from .rendezvous import STORE_FD
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
    """What a warm supervisor imported, and how to tell that it no longer matches the caller.

    Two kinds of preload. What AIR_MAGIC_PRELOAD (else PRELOAD) names is imported at start and
    is simply there in every forked worker. A call may also name modules whose `warm_up(env)` the
    supervisor runs while it is idle after that call (AIR_MAGIC_WARM_UP in the call's environment,
    comma-separated; the MLflow tracking of a call names air_magic.mlflow_worker): what a warm-up
    imports is kept out of a forked worker's sys.modules (and its atexit functions unregistered)
    until the worker's code imports it, so a worker carries only what its code imports, yet that
    import takes microseconds.
    """

    def __init__(self, warm: bool) -> None:
        self.modules: dict[str, str] = {}  # top-level package -> its directory, for the sys.path check
        self.files: dict[str, tuple[int, int]] = {}  # watched path -> (inode, mtime), see _watch
        self.env = {k: os.environ.get(k) for k in IMPORT_TIME_ENV}
        self.pending: dict[str, dict[str, str]] = {}  # warm-up module -> environment of the call that asked
        self.hidden_tops: set[str] = set()  # top-level names that warm-ups brought in
        self.exit_funcs: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        if not warm:
            return
        wanted = os.environ.get("AIR_MAGIC_PRELOAD")
        for name in [n.strip() for n in wanted.split(",") if n.strip()] if wanted is not None else PRELOAD:
            if importlib.util.find_spec(name.split(".")[0]) is None:
                continue
            module = __import__(name)
            self.modules[name.split(".")[0]] = os.path.dirname(getattr(module, "__file__", "") or "")
        self._watch(list(sys.modules.values()))

    def _watch(self, modules: list[Any]) -> None:
        """Remember how the files behind `modules` look now, cheaply enough to check on every launch.

        A module in a site-packages directory is watched through its top-level entry there (the
        package directory, or the module file): installing, upgrading or removing a distribution
        adds and removes entries in it, which changes its inode or mtime. Every other file (the
        user's own packages, editable installs) is watched itself, so an edit in place is seen.
        A few hundred stats instead of one per module: mlflow alone loads over a thousand.
        """
        stdlib = sysconfig.get_paths()["stdlib"]
        for module in modules:
            path = getattr(module, "__file__", None)
            if not path or path.startswith(stdlib):
                continue
            for marker in ("/site-packages/", "/dist-packages/"):
                cut = path.rfind(marker)
                if cut >= 0:
                    root = cut + len(marker)
                    path = path[:root] + path[root:].split("/", 1)[0]
                    break
            if path not in self.files:
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                self.files[path] = (info.st_ino, info.st_mtime_ns)

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
        for path, seen in self.files.items():
            try:
                info = os.stat(path)
            except OSError:
                return f"{path} is gone"
            if (info.st_ino, info.st_mtime_ns) != seen:
                return f"{path} changed on disk"
        return None

    # -- warm-ups: imports a call asked for, done while idle ------------------
    def ask(self, env: dict[str, str]) -> None:
        """Note the warm-ups a launched call asks for (run later, by `warm_up_now`, while idle)."""
        for name in env.get("AIR_MAGIC_WARM_UP", "").split(","):
            if name.strip():
                self.pending[name.strip()] = env

    def warm_up_now(self) -> None:
        """Run the pending warm-ups, each catching its own failure (the workers then import for themselves)."""
        import atexit

        register = atexit.register
        registered: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

        def record(func: Any, *args: Any, **kwargs: Any) -> Any:
            registered.append((func, args, kwargs))
            return register(func, *args, **kwargs)

        while self.pending:
            name, env = self.pending.popitem()
            before = set(sys.modules)
            registered.clear()
            try:
                warm_up = importlib.import_module(name).warm_up
                before = set(sys.modules)
                atexit.register = record  # type: ignore[assignment]
                try:
                    packages = warm_up(env)
                finally:
                    atexit.register = register
            except Exception as exc:  # noqa: BLE001 - a warm-up is an optimisation; say why it did not happen
                print(f"air_magic supervisor: warm-up {name} failed: {exc!r}", file=sys.stderr, flush=True)
                packages = []
            for func, _, _ in registered:
                atexit.unregister(func)  # they belong to a worker that imports the package, not to us
            self.exit_funcs += list(registered)
            added = [sys.modules[n] for n in sys.modules.keys() - before]
            tops = {n.partition(".")[0] for n in sys.modules.keys() - before}
            self.hidden_tops |= {t for t in tops if t not in before and t not in sys.stdlib_module_names}
            for package in packages or ():
                module = sys.modules.get(package)
                if module is not None and package not in self.modules:
                    self.modules[package] = os.path.dirname(getattr(module, "__file__", "") or "")
            self._watch(added)

    def hide_in_child(self) -> None:
        """In a forked worker: take what warm-ups imported out of sys.modules until the worker imports it."""
        if not self.hidden_tops:
            return
        groups: dict[str, dict[str, Any]] = {}
        for name in list(sys.modules):
            top = name.partition(".")[0]
            if top in self.hidden_tops:
                groups.setdefault(top, {})[name] = sys.modules.pop(name)
        if groups:
            sys.meta_path.insert(0, _Unhide(groups, self.exit_funcs))


class _Unhide(importlib.abc.MetaPathFinder):
    """In a forked worker, gives back a hidden package (with its submodules) when it is imported.

    The module objects are the supervisor's, already executed: the import costs a dict update.
    `importlib.util.find_spec` alone finds the package without bringing it back.
    """

    def __init__(self, groups: dict[str, dict[str, Any]], exit_funcs: list[tuple[Any, tuple[Any, ...], dict[str, Any]]]) -> None:
        self.groups = groups
        self.exit_funcs = exit_funcs

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        group = self.groups.get(name.partition(".")[0])
        module = None if group is None else group.get(name)
        if module is None:
            return None
        return importlib.util.spec_from_loader(
            name, _Restore(self, module), origin=getattr(getattr(module, "__spec__", None), "origin", None),
            is_package=hasattr(module, "__path__"),
        )

    def restore(self, top: str) -> None:
        group = self.groups.pop(top, None)
        if group is None:
            return
        sys.modules.update(group)
        for func, args, kwargs in self.exit_funcs:
            if (getattr(func, "__module__", None) or "").partition(".")[0] == top:
                import atexit

                atexit.register(func, *args, **kwargs)
        if not self.groups and self in sys.meta_path:
            sys.meta_path.remove(self)


class _Restore(importlib.abc.Loader):
    """Loader of one hidden module: hands back the supervisor's module object, executes nothing."""

    def __init__(self, finder: _Unhide, module: Any) -> None:
        self.finder = finder
        self.module = module
        self.spec = getattr(module, "__spec__", None)

    def create_module(self, spec: Any) -> Any:
        self.finder.restore(spec.name.partition(".")[0])
        return self.module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self.spec  # the import system set ours; keep the package's own


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
        elif isinstance(msg, p.DumpStacks):
            job = self.jobs.get(msg.job)
            if job is not None and job.stopper is None:
                from .stacks import request

                request(job.live_workers, list(self.processes(job)))  # a fraction of a second at most

    def launch(self, msg: p.LaunchJob) -> None:
        fork = msg.fork
        if fork and self.warm:
            reason = self.preloaded.stale_reason(msg)
            if reason is not None:
                _emit(p.Stale(msg.job, reason))
                return
            self.preloaded.ask(msg.env)
        job = Job(msg.job, msg.world_size)
        self.jobs[job.id] = job
        hot = bool(msg.keep_alive) and fork
        if hot and self.run_hot(job, msg):
            return
        env = dict(msg.env)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = job.port = sock.getsockname()[1]
        env.update(AIR_MAGIC_JOB=job.id, AIR_MAGIC_SUPERVISOR_PID=str(os.getpid()))
        store = importlib.util.find_spec("torch") is not None
        if store:
            sock.listen(max(128, 4 * job.world_size))
            job.store_pid = self.start_store(msg, env, sock, port, job.world_size, fork)
        sock.close()
        loopback_sockets(env)
        pool = None
        if hot:
            pool = job.pool = Pool(msg.world_key, job.world_size, float(msg.keep_alive or 0), port, job=job.id)
            pool.store_pid, job.store_pid = job.store_pid, None  # the store lives as long as the pool
            self.pools.append(pool)
            pipes = {rank: (os.pipe(), os.pipe()) for rank in range(job.world_size)}
        for rank in range(job.world_size):
            rank_env = dict(env, **torchrun_env(
                rank=rank, world_size=job.world_size, local_rank=rank, local_world_size=job.world_size,
                master_port=port, agent_store=store,
            ))
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
                (os.POSIX_SPAWN_DUP2, sock.fileno(), STORE_FD),
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
        env = dict(msg.env, AIR_MAGIC_JOB=job.id, AIR_MAGIC_SUPERVISOR_PID=str(os.getpid()))
        loopback_sockets(env)
        for rank, pid in pool.pids.items():
            rank_env = dict(env, **torchrun_env(
                rank=rank, world_size=job.world_size, local_rank=rank, local_world_size=job.world_size,
                master_port=pool.port,
            ))
            rank_env["AIR_MAGIC_HOT_FDS"] = os.environ.get("AIR_MAGIC_HOT_FDS", "")
            line = p.encode(p.HotCall(msg.run_dir, rank_env))
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
            self.preloaded.hide_in_child()
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
                    how = describe_returncode(code)
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
            if self.preloaded.pending and not (self.jobs or self.closing or self.retiring or select.select([0], [], [], 0)[0]):
                self.preloaded.warm_up_now()  # idle: nothing to watch, no request waiting

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
