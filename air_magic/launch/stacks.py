"""Asking ranks where they are: the signal that makes a rank write its threads' stacks to its log.

A rank registers Python's `faulthandler` for `STACKS_SIGNAL` while a call runs
(`install`): the handler is C code that writes every thread's Python stack to
the rank's log (fd 2) from inside the signal handler, so it answers while the
rank blocks in C (time.sleep, a gloo or NCCL wait, a DataLoader queue) and
pauses a healthy rank for microseconds. Processes the rank forks (DataLoader
workers) inherit the handler and the log. Between the calls of a hot rank the
signal is ignored (`pause`), so an idle rank writes nothing into the log of
a call that has ended.

`request(pids)` asks for dumps: only from processes that catch the signal (to
one that does not, the signal's default action would be death), each dump
between a header and a trailer line naming the process, written to its own
fd 2 (through /proc). Processes that share a log (a rank and its DataLoader
workers) take turns, so their dumps do not interleave; different logs are
served at once. This module owns that format; stack_dumps.py reads it back.

NCCL's flight recorder (`flight_recorder_env`) is what a GPU rank adds: which
collective each rank was in, and its sequence number, dumped into the run
directory when NCCL's watchdog times out.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: The signal a rank answers with its stacks: a real-time one, which user code and its libraries leave alone
#: (PyTorch Lightning takes SIGUSR1 on SLURM). None where the platform has none.
STACKS_SIGNAL: int | None = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None
#: At most this long is spent waiting for the dumps of one `request`, in seconds.
REQUEST_LIMIT = 0.6
#: A process's dump is complete when its log has not grown for this long, in seconds.
_SETTLED = 0.015
#: One process gets at most this long to write its dump, in seconds.
_ONE_LIMIT = 0.25
#: Stop dumps of one process closer together than this are one stop heard twice (a stop that also releases the
#: hot ranks it stops).
_AGAIN_AFTER = 2.0
_POLL = 0.003

# The lines written around each dump, and how stack_dumps.py recognizes them.
_HEADER = "air_magic: stacks of pid {pid} ({role}), {why} at {clock}, most recent call first:"
_TRAILER = "air_magic: end of the stacks of pid {pid}"
HEADER_RE = re.compile(r"^air_magic: stacks of pid (\d+) \((.*)\), (.*) at (\d\d:\d\d:\d\d), most recent call first:$")
TRAILER_RE = re.compile(r"^air_magic: end of the stacks of pid (\d+)$")
#: How those lines begin: output that could still become one is held until its line ends.
MARKS = ("air_magic: stacks of pid ", "air_magic: end of the stacks of pid ")
#: The rank's own process, as headers name it.
RANK_ROLE = "the rank"
#: Why a dump was asked for, as the header says, when its process is about to be stopped.
STOPPING = "before stopping it"
_recent: dict[int, float] = {}  # pid -> when it was asked for its stacks before a stop
_installed = False


# -- inside a rank ---------------------------------------------------------------------
def install() -> None:
    """In a rank, as a call starts: answer STACKS_SIGNAL with every thread's stack, written to fd 2 (the log)."""
    import faulthandler

    global _installed
    if STACKS_SIGNAL is None or _installed:
        return
    try:
        # What faulthandler.unregister puts back (see pause): an ignored signal, never the default (death).
        signal.signal(STACKS_SIGNAL, signal.SIG_IGN)
    except ValueError:
        pass  # not the main thread (a Ray rank runs its call in a thread): it is never paused
    faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True, chain=False)
    _installed = True


def pause() -> None:
    """In a hot rank between calls: ignore STACKS_SIGNAL, so the idle rank is neither asked nor killed."""
    import faulthandler

    global _installed
    if STACKS_SIGNAL is not None and _installed:
        faulthandler.unregister(STACKS_SIGNAL)
        _installed = False


# -- asking for dumps ------------------------------------------------------------------
def catches(pid: int, sig: int | None = STACKS_SIGNAL) -> bool:
    """True if process `pid` has a handler for `sig` (Linux: the SigCgt mask in /proc/PID/status)."""
    if sig is None:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("PPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


@dataclass
class _Target:
    pid: int
    fd: int | None  # our own descriptor on the process's fd 2
    log: tuple[int, int]  # (device, inode) of that file: processes sharing it take turns
    role: str


def _open_target(pid: int, role: str) -> _Target | None:
    try:
        fd = os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return None  # gone, or its fd 2 is not something we can open (a socket): no header, no dump
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    return _Target(pid, fd, (info.st_dev, info.st_ino), role)


def _size(fd: int) -> int:
    try:
        return os.fstat(fd).st_size
    except OSError:
        return -1


def request(
    ranks: Iterable[int], others: Iterable[int] = (), why: str = "on request", limit: float = REQUEST_LIMIT
) -> int:
    """Have the processes `ranks` (each a rank's own process) and `others` (their descendants) write their stacks.

    Only processes that catch STACKS_SIGNAL are asked, and none twice before the same stop (`why` STOPPING).
    Returns after the dumps are written, or after `limit` s; the number of processes asked.
    """
    if STACKS_SIGNAL is None:
        return 0
    now = time.monotonic()
    for pid, at in list(_recent.items()):
        if now - at > _AGAIN_AFTER:
            del _recent[pid]
    rank_pids = list(dict.fromkeys(ranks))
    other_pids = [p for p in dict.fromkeys(others) if p not in rank_pids]
    queues: dict[tuple[int, int], list[_Target]] = {}
    for pid in [*rank_pids, *sorted(other_pids)]:
        if (why == STOPPING and pid in _recent) or not catches(pid):
            continue
        role = RANK_ROLE if pid in rank_pids else f"a child of pid {_parent(pid)}"
        target = _open_target(pid, role)
        if target is not None:
            queues.setdefault(target.log, []).append(target)
    asked = 0
    deadline = now + limit
    try:
        while any(queues.values()) and time.monotonic() < deadline:
            turn = [q.pop(0) for q in queues.values() if q]
            asked += _dump_round(turn, why, min(deadline, time.monotonic() + _ONE_LIMIT))
    finally:
        for target in (t for q in queues.values() for t in q):
            if target.fd is not None:
                os.close(target.fd)
    return asked


def _dump_round(turn: list[_Target], why: str, deadline: float) -> int:
    """Header and signal to each target (each writes to a different log), then wait until every log settles."""
    assert STACKS_SIGNAL is not None
    clock = time.strftime("%H:%M:%S")
    waiting: dict[int, tuple[int, float]] = {}  # fd -> (its size when last seen to change, when)
    asked = 0
    for target in turn:
        assert target.fd is not None
        header = f"\n{_HEADER.format(pid=target.pid, role=target.role, why=why, clock=clock)}\n".encode()
        try:
            before = _size(target.fd)
            os.write(target.fd, header)
            os.kill(target.pid, STACKS_SIGNAL)
        except OSError:
            os.close(target.fd)
            target.fd = None
            continue
        if why == STOPPING:
            _recent[target.pid] = time.monotonic()
        waiting[target.fd] = (before + len(header), time.monotonic())  # past this size, the dump has begun
        asked += 1
    grown: set[int] = set()
    while waiting and time.monotonic() < deadline:
        time.sleep(_POLL)
        now = time.monotonic()
        for fd, (size, since) in list(waiting.items()):
            current = _size(fd)
            if current != size:
                grown.add(fd)
                waiting[fd] = (current, now)
            elif fd in grown and now - since >= _SETTLED:
                del waiting[fd]
    for target in turn:
        if target.fd is not None:
            try:
                os.write(target.fd, f"{_TRAILER.format(pid=target.pid)}\n".encode())
            except OSError:
                pass
            os.close(target.fd)
            target.fd = None
    return asked


# -- NCCL's flight recorder ------------------------------------------------------------
#: Entries NCCL's flight recorder keeps per rank: a ring buffer of the last collectives (a few hundred bytes each).
FLIGHT_RECORDER_ENTRIES = 2000


def flight_recorder_env(run_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """What a GPU rank's environment adds so NCCL's watchdog dumps its flight recorder into the run directory.

    Only the variables `env` does not set already; the dumps are `flight_recorder/rank_<N>` there.
    """
    out: dict[str, str] = {}
    if not any(k in env for k in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")):
        out["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if not any(k in env for k in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")):
        where = run_dir / "flight_recorder"
        try:
            where.mkdir(mode=0o700, exist_ok=True)
        except OSError:
            return out
        out["TORCH_FR_DUMP_TEMP_FILE"] = out["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(where / "rank_")
    return out


def flight_recorder_note(run_dir: Path) -> str | None:
    """Where NCCL's flight recorder dumps of a call are and how to read them; None if there are none."""
    where = run_dir / "flight_recorder"
    try:
        dumps = sorted(p.name for p in where.iterdir() if p.name.startswith("rank_"))
    except OSError:
        return None
    if not dumps:
        return None
    return (
        f"NCCL's flight recorder dumped what the collectives were doing ({', '.join(dumps)}) into {where}; read them "
        f"with: torchfrtrace {where} --prefix rank_ --allow-incomplete-ranks"
    )
