"""What runs inside one rank's process: load the payload, run it, leave a result or an error file.

This module imports no IPython, ipywidgets or MLflow: a worker carries only
what the user's code imports, plus the hook modules the job names (a
listener's way in, such as the MLflow hook). Its stdout and stderr are
already the rank's log file when it starts (the supervisor points file
descriptors 1 and 2 at it), so C and CUDA writes land there too. Results and
exceptions are pickled with every tensor on the CPU (portable.py).

Not for what a hot rank does between calls (hot.py) or its patches of torch.distributed (groups.py).
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import linecache
import os
import sys
import weakref
from pathlib import Path
from types import ModuleType

from ... import envvars, portable
from ...errors import SerializationError
from ..files.errorfile import write_error_file
from ..files.rundir import RunDir
from ..protocol import JobFile
from ..stacks import install as answer_stack_requests
from ..stacks import pause as ignore_stack_requests
from ..stopper import die_with_parent
from . import debugger as rank_debugger
from . import interrupts, memory, session, steps
from .carried import load_call
from .extension_locks import report_stale as clear_stale_build_locks
from .groups import hold_destroyed_groups, keep_process_group
from .hot import Pipes, serve

#: False after a session call whose error leaves the rank unusable (launch/rank/session.py::ends_session).
session_kept = False
#: Hook modules this process imported for the job (see JobRequest.hooks); flushed at the end.
_hooks: list[ModuleType] = []
#: The environment variable naming the pipe on which a rank says it is done, just before it exits.
DONE_FD_ENV = envvars.DONE_FD
#: That pipe, taken from the environment at start (the user's code may change the environment).
_done_fd: int | None = None


def _die_with_parent() -> None:
    """SIGKILL this process when the supervisor goes, and exit now if it already has."""
    die_with_parent(int(os.environ.get(envvars.SUPERVISOR_PID, "0")))


def _take_done_fd() -> None:
    global _done_fd
    value = os.environ.pop(DONE_FD_ENV, "")
    _done_fd = int(value) if value.isdigit() else None


def _say_done(code: int) -> None:
    """After a success: tell the supervisor the result is written and output flushed, so no one waits for the exit.

    A failure is reported when the process has exited, as before: the call then stops every rank and
    waits for all of them anyway.
    """
    if _done_fd is not None and code == 0:
        try:
            os.write(_done_fd, f"{code}\n".encode())
        except OSError:
            pass  # the supervisor sees the exit instead


def _install_hooks(names: list[str]) -> None:
    for name in names:
        module = importlib.import_module(name)
        install = getattr(module, "install", None)
        if install is not None:
            install()
        if module not in _hooks:
            _hooks.append(module)


def _apply_caller_context(spec: JobFile) -> None:
    sys.path[:] = spec.sys_path
    os.chdir(spec.cwd)
    sys.argv = [spec.name]
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, errors="backslashreplace")


def _write_result(path: Path, value: object, pickled: bool = False) -> None:
    """Write a rank's result file (`value` already pickled: bytes written as they are)."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            if pickled:
                assert isinstance(value, bytes)
                f.write(value)
            else:
                portable.dump(value, f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written result on a full disk would keep it full
        raise


def run(path: Path, rank: int) -> int:
    """Run this rank's share of the job; return the process exit code."""
    run_dir = RunDir(path)
    spec = JobFile.from_bytes(run_dir.job.read_bytes())
    interrupts.expect(spec.session is not None)
    _apply_caller_context(spec)
    faulthandler.enable()
    answer_stack_requests()  # STACKS_SIGNAL writes every thread's stack to the log (launch/stacks.py)

    def fail(exc: BaseException, code: dict[str, str] | None = None) -> int:
        write_error_file(
            run_dir.error(rank), run_dir.error_pickle(rank), exc, code_files=code, reserve=run_dir.error_reserve(rank)
        )
        return 1

    global session_kept
    session_kept = spec.session is not None
    hold_destroyed_groups()
    clear_stale_build_locks()  # a torch extension build killed midway leaves a lock later builds wait on
    rank_debugger.install(run_dir, rank)  # breakpoint() prompts in the notebook's cell (rank_debugger.py)
    if os.environ.get(envvars.WATCH) == "1":
        steps.start(run_dir.steps(rank), rank)  # step times and state for the notebook's watch (steps.py)
        if os.environ.get(envvars.PROFILE, "").isdigit():  # profile=N: torch.profiler over N steps (profiler.py)
            steps.profile(int(os.environ[envvars.PROFILE]), run_dir.trace(rank), run_dir.profile_window(rank))
    history = os.environ.get(envvars.MEMORY_HISTORY) == "1"  # CUDA's peak, and what an OOM error says (memory.py)
    memory.start(rank, run_dir.memory_snapshot(rank), run_dir.memory(rank), history)
    try:
        _install_hooks(spec.hooks)
        target, args, kwargs, sources = load_call(run_dir.payload.read_bytes())  # notebook modules first
        for filename, lines in sources["files"].items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        rank_debugger.new_call(target, sources["code"])
        if spec.session is None:
            value = target(*args, **kwargs)
        elif spec.ranks is None or rank in spec.ranks:
            value = interrupts.run_in_session(lambda: session.run(target, args, kwargs, rank))
        else:
            value = None  # a call for other ranks of the session: this one does nothing
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the caller
        exc = rank_debugger.translated(exc, rank)  # `q` at a prompt: DebuggerQuit
        memory.explain(exc)  # an out-of-memory error says what filled the memory
        if spec.session is not None:
            why = session.ends_session(exc)
            session_kept = why is None
            if why is not None:
                exc.add_note(f"air_magic: {why}, so session {spec.session!r} ends.")
        code = fail(exc, locals().get("sources", {}).get("code"))
        if not (session_kept and rank_debugger.keep(exc, locals().get("target"))):  # for %distributed_debug
            session.drop_traceback(exc)
        return code
    try:
        if spec.session is not None:
            _write_result(run_dir.result(rank), session.reply(value, rank), pickled=True)
            value = None  # the namespace holds what the session keeps; no output history
        else:
            _write_result(run_dir.result(rank), value)
    except OSError as exc:
        return fail(
            OSError(exc.errno, f"the return value of rank {rank} could not be written to {run_dir.result(rank)}: {exc}")
        )
    except Exception as exc:  # noqa: BLE001
        return fail(
            SerializationError(
                f"the return value of rank {rank} ({type(value).__name__}) could not be pickled: "
                f"{str(exc).rstrip('. ')}; "
                "return plain data (numbers, lists, dicts, tensors) or None."
            )
        )
    run_dir.error_reserve(rank).unlink(missing_ok=True)  # no error to record: give the space back
    return 0


def flush_hooks() -> None:
    """Let each hook module send what it still holds (e.g. MLflow's queued metrics) before the rank ends."""
    steps.stop()
    memory.finish()
    for hook in _hooks:
        flush = getattr(hook, "flush", None)
        if flush is not None:
            flush()


def _skip_teardown_finalizers() -> None:
    """Keep finalizers that only undo this process's own state from running at exit.

    torch registers one per operator library it defines (over a hundred once torch is
    imported), and resetting them at exit took 0.15 s of every rank's exit; the process
    ends right after, so nothing is lost. Other finalizers (temporary directories, say) run.
    """
    library = sys.modules.get("torch.library")
    teardown = getattr(library, "_del_library", None)
    registry = getattr(weakref.finalize, "_registry", None)
    if teardown is None or not isinstance(registry, dict):
        return
    for finalizer, info in list(registry.items()):
        if getattr(info, "func", None) is teardown:
            finalizer.atexit = False


def finish(code: int) -> None:
    """End the rank the way a normal exit would, minus interpreter teardown.

    Python's atexit handlers run (MLflow's asynchronous logging flushes there),
    output is flushed, then the process ends at once: the rank's function has
    returned and its result is on disk, so waiting for leftover non-daemon
    threads or for CUDA's orderly teardown would only delay the caller.
    """
    try:
        flush_hooks()
        _skip_teardown_finalizers()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        _say_done(code)
        os._exit(code)


def run_forked(run_dir: Path, rank: int) -> None:
    """Entry point of a worker forked from the warm supervisor."""
    _die_with_parent()  # the parent-death signal does not survive fork
    _take_done_fd()
    hot = os.environ.get(envvars.HOT_FDS)
    if hot:
        keep_process_group()
        pipes = interrupts.pipes = Pipes(hot, rank)  # a session call says on them when it took the call
        finish(serve(run(run_dir, rank), rank, pipes, sys.modules[__name__]))
    finish(run(run_dir, rank))


def end_call() -> None:
    """A hot rank's call is over: hooks send what they hold (metrics) and output is flushed, before it says so."""
    ignore_stack_requests()  # idle, it has no stack worth writing into the log of the call that ended
    steps.stop()
    memory.finish()
    for hook in _hooks:
        reset = getattr(hook, "reset", None)
        if reset is not None:
            reset()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def main(argv: list[str] | None = None) -> None:
    """Entry point of a spawned worker: `python -c ... <run_dir> <rank>`."""
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    _take_done_fd()
    finish(run(Path(argv[0]), int(argv[1])))
