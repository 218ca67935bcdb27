"""A rank of a command run: what a Python process that the command's own launcher started (torchrun, `python -m
torch.distributed.run`, `accelerate launch`) gets from air_magic, and the files it leaves.

The command's script has the rank hook's directory (cli/rank_hook/, only a `sitecustomize.py`) first on its
PYTHONPATH and `envvars.RANK_DIR`, the attempt's directory of the node's rank files (cli/node.py). Every Python
process under it imports that `sitecustomize`; one with `RANK` and `LOCAL_RANK` set (a launcher's child; the
launcher itself has no RANK) calls `hook()` here, which makes it a rank of the run:

- its stdout and stderr are teed at the file-descriptor level (C-level output too) by a small forked process
  into `rank_<R>.log`, and still reach the original descriptors (the node's log, `--watch`); the tee outlives the
  rank, so a crash's or a `kill -9`'s last lines are kept; every second with output it notes (time, byte offset)
  in `rank_<R>.log.times`, which `logs --minutes` reads (node.py keeps one for the node's log);
- `STACKS_SIGNAL` makes it write every thread's Python stack into `rank_<R>.stacks` (faulthandler: it answers
  while the rank blocks in C), which `air-magic stacks` asks for;
- `rank_<R>.json` says its pid (and create time), rank, local rank, node and start, once the above is in place;
- once the rank's own code has imported torch (never sooner: variables it sets first, such as OMP_NUM_THREADS, keep
  their effect), it records its steps into `rank_<R>.steps.json` as a function's rank does (launch/rank/steps.py,
  which imports the air_magic package then): the node's watch reads them (cli/command_watch.py);
- `breakpoint()` (and, once torch is in, `pdb.set_trace()` and `torch.distributed.breakpoint()`) stops in air_magic's
  rank debugger, whose prompt waits in the node's rank directory until `air-magic attach` or `run --watch` answers
  it from a terminal (cli/prompts.py).

Its children (DataLoader workers, a subprocess) inherit `envvars.RANK_HOOKED` and are not ranks of their own.
The hook never breaks the process: any failure is silent (`AIR_MAGIC_RANK_HOOK=debug` says it on stderr).
This module imports nothing heavy (no torch, no IPython, no MLflow, not the air_magic package until torch is in):
the hook loads it from its file, with envvars.py. Over 300 lines because all that a process gets from the hook
before its own code runs (the tee and its time index, stacks, the info file, the step recorder's and the
debugger's hooks) must load from this one file, without the package. Not for: reading the files back
(cli/show.py, cli/stacks.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

#: The signal a command run's rank answers with its threads' stacks: a real-time one, which user code leaves alone,
#: and not launch/stacks.py's (the helper asks a rank's descendants that catch that one, into their stderr).
STACKS_SIGNAL: int | None = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else None
#: A log's time index gets a line (time, byte offset) at most this often, in seconds, while output comes.
INDEX_EVERY = 1.0

_kept: list[Any] = []  # the stacks file faulthandler writes to, kept open for the process's life
_debugging: list[int] = []  # [rank] once air_magic's debugger is installed in this process


def _envvars() -> ModuleType:
    """air_magic/envvars.py: the package's when this module is imported as air_magic.cli.command_rank, else loaded
    from its file (the hook), so that a rank does not import the package."""
    if __package__:
        from .. import envvars

        return envvars
    import importlib.util

    spec = importlib.util.spec_from_file_location("_air_magic_envvars", Path(__file__).parent.parent / "envvars.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_file(directory: Path, rank: int, suffix: str) -> Path:
    """A rank's file in its node's directory: `rank_<R>.<suffix>` (log, json, stacks)."""
    return Path(directory) / f"rank_{rank}.{suffix}"


def times_of(log: Path) -> Path:
    """The time index of log `log`."""
    return log.with_name(log.name + ".times")


# -- when each byte of a log was written -------------------------------------------------
class TimeIndex:
    """Notes in a log's time index when its output came: `note(n)` before n bytes are appended."""

    def __init__(self, log: Path, offset: int) -> None:
        self.fd = os.open(times_of(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.offset = offset
        self.last = -INDEX_EVERY

    def close(self) -> None:
        os.close(self.fd)

    def note(self, size: int) -> None:
        now = time.time()
        if now - self.last >= INDEX_EVERY:
            self.last = now
            try:
                os.write(self.fd, f"{now:.3f} {self.offset}\n".encode())
            except OSError:
                pass
        self.offset += size


def lines_since(log: Path, cutoff: float) -> list[str] | None:
    """The lines of `log` written at `cutoff` (a Unix time) or later, from its time index (each line whole); None if
    it has no index."""
    try:
        entries = times_of(log).read_text().split("\n")
        data = log.read_bytes()
    except OSError:
        return None
    start = len(data)
    for entry in entries:
        at, _, offset = entry.partition(" ")
        try:
            if float(at) > cutoff - INDEX_EVERY:  # an entry's bytes came within INDEX_EVERY of its time
                start = min(int(offset), len(data))
                break
        except ValueError:
            continue
    start = data.rfind(b"\n", 0, start) + 1 if start < len(data) else start
    return data[start:].decode(errors="replace").splitlines()


# -- the tee -------------------------------------------------------------------------------
def _write_all(fd: int, data: bytes) -> bool:
    try:
        while data:
            data = data[os.write(fd, data) :]
        return True
    except OSError:
        return False


def _copy(sources: dict[int, int], log_fd: int, index: TimeIndex) -> None:
    """Until every source ends: each source's output to its original descriptor and to the rank's log."""
    import select

    poller = select.poll()
    for fd in sources:
        poller.register(fd, select.POLLIN)
    live = set(sources)
    dead: set[int] = set()  # originals that can no longer be written (a reader gone)
    while live:
        for fd, _ in poller.poll():
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                poller.unregister(fd)
                live.discard(fd)
                continue
            original = sources[fd]
            if original not in dead and not _write_all(original, data):
                dead.add(original)
            index.note(len(data))
            _write_all(log_fd, data)


def _start_tee(log: Path) -> None:
    """Fork the tee and make this process's fds 1 and 2 its pipes."""
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    index = TimeIndex(log, os.fstat(log_fd).st_size)
    pipes = {original: os.pipe() for original in (1, 2)}
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    pid = os.fork()
    if pid == 0:  # the tee: ends when every writer of its pipes (the rank, its children) is gone
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)  # the rank's last words come after a Ctrl-C or a SIGTERM
            for _, write in pipes.values():
                os.close(write)
            _copy({read: original for original, (read, _) in pipes.items()}, log_fd, index)
        finally:
            os._exit(0)
    os.close(log_fd)
    os.close(index.fd)
    for original, (read, write) in pipes.items():
        os.close(read)
        os.dup2(write, original)
        os.close(write)


# -- the steps, once torch is in ----------------------------------------------------------------
class _AfterImport:
    """A `sys.meta_path` finder that calls `then()` once module `name`'s body has run, the first time it is
    imported, and otherwise changes nothing of that import."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the finders after this one
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, then = loader.exec_module, self.then

        def exec_then(module: ModuleType) -> None:
            exec_module(module)
            try:
                then()
            except Exception:  # noqa: BLE001, S110 - the rank runs on unwatched
                pass

        loader.exec_module = exec_then
        return spec


def _debugger(directory: Path, rank: int) -> None:
    """From here on `pdb.Pdb` is air_magic's rank debugger (launch/rank/debugger.py), whose prompts wait in the
    node's rank directory for `air-magic attach` (or `run --watch`) to answer them (cli/prompts.py). On a node of a
    Ray cluster, whose files no follower here reads, it raises at once instead, saying so, as a function's rank
    there does (the node's own rank has no `DEBUG_SERVED`, and the command inherits its environment)."""
    from air_magic.launch.files.rundir import RunDir
    from air_magic.launch.rank import debugger

    debugger.install(RunDir(directory), rank)  # served where the node's launcher serves its own ranks (not on Ray)
    _debugging.append(rank)


def _breakpoint_hook(directory: Path, rank: int) -> Any:
    """`sys.breakpointhook` of a rank: the first `breakpoint()` loads the debugger (the package is imported then, not
    before), and stops in its caller's frame. `PYTHONBREAKPOINT` keeps its meaning (0 skips breakpoints)."""
    default = sys.breakpointhook

    def hook(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get("PYTHONBREAKPOINT"):
            return default(*args, **kwargs)
        import pdb  # noqa: T100 - what breakpoint() is for

        if not _debugging:
            _debugger(directory, rank)
        pdb.Pdb(skip=["_air_magic_*"]).set_trace(sys._getframe(1))  # stops in the frame that called breakpoint()
        return None

    return hook


def _record_steps(directory: Path, rank: int) -> None:
    """Record this rank's steps for the node's watch, from when its code has imported torch."""

    def start() -> None:
        from air_magic.launch.rank import steps

        steps.start(rank_file(directory, rank, "steps.json"), rank)
        _debugger(directory, rank)  # pdb.set_trace() and torch.distributed.breakpoint() land there too

    if "torch" in sys.modules:
        start()
    else:
        sys.meta_path.insert(0, _AfterImport("torch", start))


# -- the hook ---------------------------------------------------------------------------------
def _create_time() -> float | None:
    """This process's create time as psutil says it (boot time + start ticks), without psutil; None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001, S110 - a closed stream at exit: nothing left to write
            pass


def _become_rank(directory: Path, rank: int, local_rank: int) -> None:
    import atexit
    import faulthandler

    directory.mkdir(parents=True, exist_ok=True)
    _start_tee(rank_file(directory, rank, "log"))
    atexit.register(_flush)
    if STACKS_SIGNAL is not None:
        fd = os.open(rank_file(directory, rank, "stacks"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        stacks = os.fdopen(fd, "ab")
        _kept.append(stacks)
        faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
    info = {
        "pid": os.getpid(),
        "create_time": _create_time(),
        "rank": rank,
        "local_rank": local_rank,
        "node": int(os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or 0),
        "host": socket.gethostname(),  # its pid means something on this machine only (command_watch.here)
        "world_size": int(os.environ.get("WORLD_SIZE") or 0),
        "started": time.time(),
        "argv": sys.argv[:8],
        "stacks_signal": STACKS_SIGNAL,
    }
    path = rank_file(directory, rank, "json")
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(path.with_suffix(".tmp"), path)
    sys.breakpointhook = _breakpoint_hook(directory, rank)
    if os.environ.get(_envvars().RANK_HOOK) != "no-watch":
        _record_steps(directory, rank)


def hook() -> None:
    """Called by the rank hook's sitecustomize in a process with RANK and LOCAL_RANK: make it a rank of the command
    run whose rank directory the environment names, once (not its children); never raises."""
    debug = False
    try:
        envvars = _envvars()
        setting = os.environ.get(envvars.RANK_HOOK, "")
        debug = setting == "debug"
        directory = os.environ.get(envvars.RANK_DIR)
        if not directory or setting == "0" or os.environ.get(envvars.RANK_HOOKED):
            return
        os.environ[envvars.RANK_HOOKED] = str(os.getpid())
        _become_rank(Path(directory), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]))
    except Exception:  # noqa: BLE001 - the user's process runs on without what the hook gives
        if debug:
            import traceback

            print("air_magic rank hook failed:", file=sys.stderr)
            traceback.print_exc()
