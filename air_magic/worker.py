"""What runs inside one rank's process: load the payload, run it, leave a result or an error file.

This module imports no IPython, ipywidgets or MLflow: a worker carries only
what the user's code imports. Its stdout and stderr are already the rank's
log file when it starts (the supervisor points file descriptors 1 and 2 at
it), so C and CUDA writes land there too.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import json
import linecache
import os
import signal
import sys
from pathlib import Path

import cloudpickle

from .errors import SerializationError, write_error_file

_PR_SET_PDEATHSIG = 1


def result_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank-{rank}.result.pkl"


def error_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank-{rank}.error.json"


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the supervisor goes, then check it has not already."""
    parent = int(os.environ.get("AIR_MAGIC_SUPERVISOR_PID", "0"))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: rely on the supervisor's sweep
        pass
    if parent and os.getppid() != parent:
        os._exit(70)


def _apply_caller_context(spec: dict) -> None:
    sys.path[:] = spec["sys_path"]
    os.chdir(spec["cwd"])
    sys.argv = [spec["name"]]
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, errors="backslashreplace")


def _write_result(path: Path, value: object) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            cloudpickle.dump(value, f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written result on a full disk would keep it full
        raise


def run(run_dir: Path, rank: int) -> int:
    """Run this rank's share of the job; return the process exit code."""
    spec = json.loads((run_dir / "job.json").read_text())
    _apply_caller_context(spec)
    faulthandler.enable()
    if os.environ.get("AIR_MAGIC_MLFLOW_RUN_ID"):  # the call has an MLflow run: see mlflow_worker.py
        from .mlflow_worker import install

        install()
    try:
        target, args, kwargs, sources = cloudpickle.loads((run_dir / "payload.pkl").read_bytes())
        for filename, lines in sources["files"].items():
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        value = target(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the caller
        write_error_file(error_path(run_dir, rank), exc, code_files=locals().get("sources", {}).get("code"))
        return 1
    try:
        _write_result(result_path(run_dir, rank), value)
    except OSError as exc:
        err: BaseException = OSError(
            exc.errno, f"the return value of rank {rank} could not be written to {result_path(run_dir, rank)}: {exc}"
        )
        write_error_file(error_path(run_dir, rank), err)
        return 1
    except Exception as exc:  # noqa: BLE001
        err = SerializationError(
            f"the return value of rank {rank} ({type(value).__name__}) could not be pickled: {exc}; "
            "return plain data (numbers, lists, dicts, tensors moved to CPU) or None."
        )
        write_error_file(error_path(run_dir, rank), err)
        return 1
    return 0


def finish(code: int) -> None:
    """End the rank the way a normal exit would, minus interpreter teardown.

    Python's atexit handlers run (MLflow's asynchronous logging flushes there),
    output is flushed, then the process ends at once: the rank's function has
    returned and its result is on disk, so waiting for leftover non-daemon
    threads or for CUDA's orderly teardown would only delay the caller.
    """
    try:
        if os.environ.get("AIR_MAGIC_MLFLOW_RUN_ID"):
            from .mlflow_worker import flush, leave_run_to_notebook

            flush()  # MLflow's queued metrics, before anything else ends
            leave_run_to_notebook()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def run_forked(run_dir: Path, rank: int) -> None:
    """Entry point of a worker forked from the warm supervisor."""
    _die_with_parent()  # the parent-death signal does not survive fork
    finish(run(run_dir, rank))


def main(argv: list[str] | None = None) -> None:
    """Entry point of a spawned worker: `python -c ... <run_dir> <rank>`."""
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    finish(run(Path(argv[0]), int(argv[1])))
