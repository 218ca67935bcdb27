"""The files through which a rank's debugger and the notebook talk: one prompt out, one answer back.

A rank stopped in its debugger (rank_debugger.py) opens its answers FIFO
(`RunDir.debug_answers`, mode 0600, in the private run directory), then writes
`RunDir.debug_wait`: JSON with its pid, where it stopped, what the debugger
printed since the last answer, and its prompt. It then blocks reading one line
from the FIFO. Whoever answers (the runner's wait loop, or
`%distributed_debug` attaching to a background call) reads the wait file,
asks a person, removes the wait file, and writes the answer line to the FIFO.
A wait file that exists is therefore a rank waiting at a prompt now: the
panel and `waiting` read that.

Nothing here listens on a socket; both ends are files of the run directory.
This module is the one owner of that format; it starts nothing and imports no
IPython (ranks import it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .rundir import RunDir

#: Seconds the answering side retries a FIFO that has no reader yet, before it says the rank is gone.
OPEN_RETRY = 2.0


@dataclass(frozen=True)
class Prompt:
    """A rank waiting in its debugger: what it printed, its prompt, and where it stopped."""

    rank: int
    pid: int
    prompt: str
    #: What the debugger printed since the last answer (the prompt itself left out).
    output: str = ""
    #: `file:line` of the frame the debugger is in.
    where: str = ""
    #: Wall time the rank started waiting.
    at: float = 0.0


# -- the rank's side ------------------------------------------------------------------
def open_answers(run_dir: RunDir, rank: int) -> int:
    """Make the rank's answers FIFO if needed and open it for reading (read-write: no writer is needed yet)."""
    path = run_dir.debug_answers(rank)
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        info = os.lstat(path)
        if not stat.S_ISFIFO(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(f"{path} is not this user's FIFO; the debugger will not read from it") from None
    return os.open(path, os.O_RDWR | os.O_NOFOLLOW)


def post(run_dir: RunDir, prompt: Prompt) -> None:
    """Say the rank waits at `prompt` (written whole: a reader never sees half of it)."""
    path = run_dir.debug_wait(prompt.rank)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(prompt), f)
    os.replace(tmp, path)


def read_line(fd: int) -> str:
    """One answer line from the FIFO, without its newline (blocks until it comes)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)  # byte by byte: what follows the line stays for the next prompt
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", errors="replace").rstrip("\r\n")


def withdraw(run_dir: RunDir, rank: int) -> None:
    """The rank no longer waits (it was interrupted at its prompt)."""
    with contextlib.suppress(OSError):
        run_dir.debug_wait(rank).unlink()


# -- the answering side ------------------------------------------------------------------
def waiting(run_dir: Path, world_size: int) -> dict[int, Prompt]:
    """The ranks of a call waiting at a debugger prompt now, with their prompts."""
    rd = RunDir(run_dir)
    found: dict[int, Prompt] = {}
    for rank in range(world_size):
        prompt = read_prompt(rd, rank)
        if prompt is not None:
            found[rank] = prompt
    return found


def waiting_note(ranks: set[int] | list[int]) -> str:
    """What a panel or a listing says of ranks at a debugger prompt, with the magic that attaches to one."""
    if not ranks:
        return ""
    first = min(ranks)
    which = ", ".join(map(str, sorted(ranks)))
    return f"rank {which} at a breakpoint (%distributed_debug --rank {first})"


def read_prompt(run_dir: RunDir, rank: int) -> Prompt | None:
    try:
        data = json.loads(run_dir.debug_wait(rank).read_text())
        return Prompt(**data)
    except (OSError, ValueError, TypeError):
        return None


def answer(run_dir: RunDir, rank: int, line: str) -> bool:
    """Hand `line` to the rank waiting at its prompt; False when no rank reads its FIFO any more (it is gone)."""
    with contextlib.suppress(OSError):
        run_dir.debug_wait(rank).unlink()
    deadline = time.monotonic() + OPEN_RETRY
    while True:
        try:
            fd = os.open(run_dir.debug_answers(rank), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            break
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.ENOENT) or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def alive(prompt: Prompt) -> bool:
    """The process that posted `prompt` still exists."""
    try:
        os.kill(prompt.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean(run_dir: Path, world_size: int) -> None:
    """Remove the debugger's files of a call that ended (its ranks are gone)."""
    rd = RunDir(run_dir)
    for rank in range(world_size):
        for path in (rd.debug_wait(rank), rd.debug_answers(rank)):
            with contextlib.suppress(OSError):
                path.unlink()
