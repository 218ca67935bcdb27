"""Asking ranks where they are: the signal that makes a rank write its threads' stacks to its log.

A rank registers Python's `faulthandler` for `STACKS_SIGNAL` while a call runs (`install`): the handler is C code
that writes every thread's Python stack to the rank's log (fd 2) from inside the signal handler, so it answers while
the rank blocks in C (time.sleep, a gloo or NCCL wait, a DataLoader queue) and pauses a healthy rank for
microseconds. Processes the rank forks (DataLoader workers) inherit the handler and the log. Between the calls of a
hot rank the signal is ignored (`pause`), so an idle rank writes nothing into the log of a call that has ended.

`request(pids)` asks for dumps: only from processes that catch the signal (to one that does not, the signal's
default action would be death), each dump between a header and a trailer line naming the process, written to its
own fd 2 (through /proc). Processes that share a log (a rank and its DataLoader workers) take turns, so their dumps
do not interleave; different logs are served at once. This module owns that format; stack_dumps.py reads it back.

A rank's own process also gets its native frames, from py-spy (native_frames.py), written into the same dump:
where in C, C++ or CUDA code each thread waits. NCCL's flight recorder (flight_recorder.py) says which collective
each rank is in.

Over 300 lines because asking for stacks has two parts that must agree on one format: the rank's handler and the
request, with the turns askers in different processes take.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

from . import native_frames
from .load import patience
from .native_frames import native_stacks

#: The signal a rank answers with its stacks: a real-time one, which user code and its libraries leave alone
#: (PyTorch Lightning takes SIGUSR1 on SLURM). None where the platform has none.
STACKS_SIGNAL: int | None = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None
#: At most this long is spent waiting for the dumps of one `request`, in seconds (py-spy's reading of native frames
#: aside). A healthy rank answers in milliseconds; with every core busy, a process waits to be scheduled, the longer
#: the more processes want each core: the limits here are stretched by `load.patience()`.
REQUEST_LIMIT = 2.0
#: A process's dump is complete when its handler has returned (Linux: see `_answering`) and its log has not grown
#: for this long, in seconds, stretched by the load. Where /proc cannot say whether the handler still runs, the
#: quiet log is all: on a busy machine the signal's thread can wait to be scheduled between two threads' stacks (at
#: a load of 12 on 2 cores, a rank's dump was cut after the first threads and its call's thread, written after the
#: trailer, was not read).
_SETTLED = 0.015
#: One process gets at most this long to write its dump, in seconds.
_ONE_LIMIT = 1.0
#: Stop dumps of one process (the same process: its start time) closer together than this, stretched by the load,
#: are one stop heard twice (a stop that also releases the hot ranks it stops: 3 s apart on a busy machine, where
#: the second dump, of a rank already ending, was empty and was read as where it stopped).
_AGAIN_AFTER = 30.0
_POLL = 0.003

# The lines written around each dump, and how stack_dumps.py recognizes them.
_HEADER = "air_magic: stacks of pid {pid} ({role}), {why} at {clock}, most recent call first:"
_TRAILER = "air_magic: end of the stacks of pid {pid}"
HEADER_RE = re.compile(r"^air_magic: stacks of pid (\d+) \((.*)\), (.*) at (\d\d:\d\d:\d\d), most recent call first:$")
TRAILER_RE = re.compile(r"^air_magic: end of the stacks of pid (\d+)$")
#: How those lines begin: output that could still become one is held until its line ends.
MARKS = ("air_magic: stacks of pid ", "air_magic: end of the stacks of pid ")
#: Seconds a dump may take past its limits (the header, the trailer, starting py-spy).
_DUMP_SLACK = 2.0
#: The rank's own process, as headers name it.
RANK_ROLE = "the rank"
#: Why a dump was asked for, as the header says, when its process is about to be stopped.
STOPPING = "before stopping it"
_recent: dict[int, tuple[str, float]] = {}  # pid -> its start, and when it was asked for its stacks before a stop
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
    _let_py_spy_attach()
    _installed = True


def _let_py_spy_attach() -> None:
    """Where Yama restricts ptrace to a process's ancestors, let the process that asks for this rank's stacks (the
    helper; a Ray rank asks itself) and what it starts (py-spy) attach to it. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    from .. import envvars

    asker = int(os.environ.get(envvars.SUPERVISOR_PID) or os.getpid())
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(0x59616D61, asker, 0, 0, 0)  # PR_SET_PTRACER; fails harmlessly without Yama
    except (OSError, AttributeError):
        pass


def pause() -> None:
    """In a hot rank between calls: ignore STACKS_SIGNAL, so the idle rank is neither asked nor killed."""
    import faulthandler

    global _installed
    if STACKS_SIGNAL is not None and _installed:
        faulthandler.unregister(STACKS_SIGNAL)
        _installed = False


# -- asking for dumps ------------------------------------------------------------------
def longest_dump() -> float:
    """The longest one process's dump holds its log, in seconds, at this machine's load: its Python stacks
    (`_ONE_LIMIT`, stretched), then its native frames (py-spy, under a watchdog that ends it at NATIVE_LIMIT).

    A stop waits this long for another asker's dump in the same log to end before it asks for its own (the stop's
    stacks are what the record keeps), and whoever waits for a stop's dump allows for that turn.
    """
    return _ONE_LIMIT * patience() + native_frames.NATIVE_LIMIT + _DUMP_SLACK


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


def _started(pid: int) -> str:
    """When process `pid` started, as /proc says (its `stat`'s 22nd field); "" where it cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return ""


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
    Returns after the dumps are written, or after `limit` s times `patience()`; the number of processes asked.
    """
    if STACKS_SIGNAL is None:
        return 0
    now = time.monotonic()
    stretch = patience()
    limit *= stretch
    for pid, (start, at) in list(_recent.items()):
        if now - at > _AGAIN_AFTER * stretch or _started(pid) != start:
            del _recent[pid]  # long ago, or another process under the same pid
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
            waited = time.monotonic()
            turn = _take_turns(turn, time.monotonic() + (longest_dump() if why == STOPPING else REQUEST_LIMIT))
            deadline += time.monotonic() - waited  # another asker's dump in the same log is not this one's time
            until = min(deadline, time.monotonic() + _ONE_LIMIT * stretch)
            done, native_s = _dump_round(turn, why, until, _SETTLED * stretch)
            asked += done
            deadline += native_s  # py-spy's time is not taken from the processes still to answer (a rank's children)
    finally:
        for target in (t for q in queues.values() for t in q):
            if target.fd is not None:
                os.close(target.fd)
    return asked


def request_in_background(ranks: Iterable[int], others: Iterable[int] = (), why: str = "on request") -> None:
    """`request` in a short-lived process of its own, so that the asker goes on at once (the helper's loop serves
    every call's events while py-spy reads native frames, up to `longest_dump()`); the helper reaps it."""
    import json

    ranks, others = list(ranks), list(others)
    parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from air_magic.launch.stacks import request; "
        "request(*json.loads(sys.argv[2]))"
    )
    try:
        subprocess.Popen(
            [sys.executable, "-c", code, parent, json.dumps([list(ranks), list(others), why])],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        request(ranks, others, why)  # no process to spare: ask from here


def _take_turns(turn: list[_Target], deadline: float) -> list[_Target]:
    """The targets whose log this process now holds for one dump (an exclusive `flock` on it, released when the
    target's descriptor is closed), waiting until `deadline` for another process's dump in the same log to end.

    Askers in different processes (a Stacks click's short-lived process, the helper stopping the ranks) would
    otherwise write their headers one after another before either dump, and the dumps would be read under the
    wrong header. A log that cannot be locked is asked at once; one still held at `deadline` is not asked.
    """
    held = []
    for target in turn:
        assert target.fd is not None
        while True:
            try:
                fcntl.flock(target.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(_POLL)
                    continue
                os.close(target.fd)
                target.fd = None
                break
            except OSError:
                pass  # not a file that takes locks: asked without a turn
            held.append(target)
            break
    return held


@dataclass(frozen=True)
class _SignalState:
    """What /proc says of a process and one signal: pending for it, the threads blocking it, all its threads."""

    pending: bool
    blocking: frozenset[int]
    threads: frozenset[int]


def _signal_state(pid: int, sig: int) -> _SignalState | None:
    """`sig` in process `pid` now; None where /proc does not say (the process has ended, or the platform has no
    /proc)."""
    bit = 1 << (sig - 1)

    def masks(path: str) -> dict[str, bool]:
        with open(path) as f:
            return {
                line[:6]: bool(int(line.split()[1], 16) & bit)
                for line in f
                if line.startswith(("ShdPnd", "SigPnd", "SigBlk"))
            }

    try:
        pending = masks(f"/proc/{pid}/status")["ShdPnd"]
        blocking, threads = set(), set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                seen = masks(f"/proc/{pid}/task/{tid}/status")
            except OSError:
                continue  # a thread that ended meanwhile
            threads.add(int(tid))
            pending = pending or seen.get("SigPnd", False)
            if seen.get("SigBlk", False):
                blocking.add(int(tid))
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return _SignalState(pending, frozenset(blocking), frozenset(threads))


def _answering(pid: int, before: _SignalState | None) -> bool | None:
    """True while process `pid` has still to write its dump: STACKS_SIGNAL is pending, or a thread runs its handler.

    faulthandler's handler is installed without SA_NODEFER, so the kernel blocks the signal in the thread that runs
    it until it returns: a thread that was there and did not block the signal when it was sent (`before`), and
    blocks it now, is writing the dump, however long the scheduler keeps it from running. None where /proc cannot
    say.
    """
    assert STACKS_SIGNAL is not None
    if before is None:
        return None
    now = _signal_state(pid, STACKS_SIGNAL)
    if now is None:
        return False  # it has ended: it writes nothing more
    return now.pending or bool((now.blocking - before.blocking) & before.threads)


def _dump_round(turn: list[_Target], why: str, deadline: float, settled: float = _SETTLED) -> tuple[int, float]:
    """Header and signal to each target (each writes to a different log), then wait until every target's handler
    has returned and its log has not grown for `settled` s; the number asked, and the seconds py-spy took to read
    the ranks' native frames."""
    assert STACKS_SIGNAL is not None
    clock = time.strftime("%H:%M:%S")
    waiting: dict[int, tuple[int, float]] = {}  # fd -> (its size when last seen to change, when)
    signalled: dict[int, _SignalState | None] = {}  # fd -> its process and the signal as it was sent
    pids: dict[int, int] = {}
    asked = 0
    for target in turn:
        assert target.fd is not None
        header = f"\n{_HEADER.format(pid=target.pid, role=target.role, why=why, clock=clock)}\n".encode()
        state = _signal_state(target.pid, STACKS_SIGNAL)
        try:
            before = _size(target.fd)
            os.write(target.fd, header)
            os.kill(target.pid, STACKS_SIGNAL)
        except OSError:
            os.close(target.fd)
            target.fd = None
            continue
        if why == STOPPING:
            _recent[target.pid] = (_started(target.pid), time.monotonic())
        waiting[target.fd] = (before + len(header), time.monotonic())  # past this size, the dump has begun
        signalled[target.fd] = state if state is not None and not state.pending else None
        pids[target.fd] = target.pid
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
            elif fd in grown and now - since >= settled and not _answering(pids[fd], signalled[fd]):
                del waiting[fd]
    native_start = time.monotonic()
    natives = native_stacks([t.pid for t in turn if t.fd is not None and t.role == RANK_ROLE])
    native_s = time.monotonic() - native_start
    for target in turn:
        if target.fd is not None:
            try:
                if target.pid in natives:
                    os.write(target.fd, natives[target.pid].encode())
                os.write(target.fd, f"{_TRAILER.format(pid=target.pid)}\n".encode())
            except OSError:
                pass
            os.close(target.fd)
            target.fd = None
    return asked, native_s
