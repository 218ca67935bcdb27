"""A rank's native frames (where in C, C++ or CUDA code each thread waits), read by py-spy for its stacks dump.

stacks.py writes what `native_stacks` returns into a rank's dump, between the Python stacks and the trailer;
files/stack_dumps.py reads it back through the lines defined here.

py-spy stops the process it reads (its native unwinding needs ptrace; `--nonblocking` cannot be had with
`--native`). Where the asker is that process itself (a Ray rank answers its own Stacks request), a limit kept by a
thread of the asker cannot fire while py-spy holds it. So each py-spy runs under a watchdog of its own, outside the
process it reads (coreutils `timeout`): at `limit` s the watchdog kills py-spy, and sends the process SIGCONT, since
a tracer killed midway can leave the process it attached to stopped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

#: At most this long is spent on the native frames of one round of a `stacks.request`, in seconds (py-spy reads
#: the symbols of every library the rank loaded: about 0.3 s for a torch rank on a quiet machine).
NATIVE_LIMIT = 15.0
#: A native frame's line is cut at this many characters (a C++ template's name can take thousands).
NATIVE_LINE = 300
#: The lines written into a dump: one that says native frames follow, then each of py-spy's lines after
#: NATIVE_MARK; or one line saying why there are none.
_NATIVE = "air_magic: native stacks of pid {pid} (py-spy dump --native):"
_NO_NATIVE = "air_magic: no native stacks of pid {pid}: {why}"
NATIVE_RE = re.compile(r"^air_magic: native stacks of pid (\d+) \(py-spy dump --native\):$")
NO_NATIVE_RE = re.compile(r"^air_magic: no native stacks of pid (\d+): (.*)$")
NATIVE_MARK = "  | "
_COLOUR_RE = re.compile(r"\x1b\[[0-9;]*m")
#: The watchdog: py-spy under `timeout`, which kills it at the limit (exit _KILLED_AT_LIMIT); then the target is let
#: go on. Arguments: limit, py-spy, pid.
_WATCHDOG = (
    'timeout -s KILL "$1" "$2" dump --native --pid "$3"; rc=$?; [ $rc -eq 137 ] && kill -CONT "$3" 2>/dev/null; '
    "exit $rc"
)
#: The watchdog's exit when it killed py-spy at the limit (`timeout -s KILL`: 128 + SIGKILL).
_KILLED_AT_LIMIT = 137
#: Seconds given to the watchdog, past the limit, to kill py-spy and end, before the asker gives up on it.
_WATCHDOG_GRACE = 5.0


def py_spy() -> str | None:
    """The py-spy program: on PATH, or beside this Python (a virtual environment's bin/)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else None


def _why_not(output: str) -> str:
    """py-spy's own words on why it could not attach, with what to do where it is a permission."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    said = "; ".join(lines[-2:])[:300] or "no output"
    if re.search(r"permission denied|not permitted|os error (1|13)\b", output, re.IGNORECASE):
        return (
            f"the platform does not let py-spy attach (ptrace not permitted: {said}); allow it with "
            "kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE in a container"
        )
    return f"py-spy failed: {said}"


def _command(program: str, pid: int, limit: float, watched: bool) -> list[str]:
    """py-spy's command line for `pid`: under the watchdog if `watched`, else bare (the asker's own limit is all)."""
    if watched:
        return ["sh", "-c", _WATCHDOG, "sh", f"{limit:g}", program, str(pid)]
    return [program, "dump", "--native", "--pid", str(pid)]


def native_stacks(pids: list[int], limit: float | None = None) -> dict[int, str]:
    """Each process's native frames, as the lines written into its dump (or the line saying why there are none).

    py-spy is run for every process at once and given `limit` s (NATIVE_LIMIT if None) in all.
    """
    if not pids:
        return {}
    limit = NATIVE_LIMIT if limit is None else limit
    program = py_spy()
    if program is None:
        missing = "py-spy is not installed (pip install py-spy)"
        return {pid: _NO_NATIVE.format(pid=pid, why=missing) + "\n" for pid in pids}
    watched = bool(shutil.which("timeout") and shutil.which("sh"))  # the watchdog's parts (Linux: coreutils)

    def late(pid: int) -> str:
        return _NO_NATIVE.format(pid=pid, why=f"py-spy did not answer within {limit:g} s") + "\n"

    running: dict[int, subprocess.Popen[bytes]] = {}
    out: dict[int, str] = {}
    for pid in pids:
        try:
            running[pid] = subprocess.Popen(
                _command(program, pid, limit, watched),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NO_COLOR": "1", "CLICOLOR": "0", "CLICOLOR_FORCE": "0", "TERM": "dumb"},
            )
        except OSError as exc:
            out[pid] = _NO_NATIVE.format(pid=pid, why=f"py-spy could not start: {exc}") + "\n"
    deadline = time.monotonic() + limit + (_WATCHDOG_GRACE if watched else 0.0)
    for pid, proc in running.items():
        try:
            raw = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out[pid] = late(pid)
            continue
        text = _COLOUR_RE.sub("", raw)  # py-spy colours its output when it thinks a terminal reads it
        if watched and proc.returncode == _KILLED_AT_LIMIT:
            out[pid] = late(pid)
        elif proc.returncode != 0 or not text.strip():
            out[pid] = _NO_NATIVE.format(pid=pid, why=_why_not(text)) + "\n"
        else:
            lines = [line[: NATIVE_LINE - 1] + "…" if len(line) > NATIVE_LINE else line for line in text.splitlines()]
            body = "".join(f"{NATIVE_MARK}{line}\n" for line in lines)
            out[pid] = _NATIVE.format(pid=pid) + "\n" + body
    return out
