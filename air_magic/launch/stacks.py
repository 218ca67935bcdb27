"""Where every rank is: the signal that makes a rank write its threads' stacks to its log, and reading them back.

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
preceded by a header line naming the process, written to its own fd 2
(through /proc). Processes that share a log (a rank and its DataLoader
workers) take turns, so their dumps do not interleave; different logs are
served at once.

`StackScanner` finds those dumps in a rank's output as it arrives, and
`parse` in a whole log. A `Dump` reads like a traceback: in each thread the
outermost frame first and the innermost last, the thread running the call
(user code) first; `Dump.user_frame` is the innermost frame of user code.

NCCL's flight recorder (`flight_recorder_env`) is what a GPU rank adds: which
collective each rank was in, and its sequence number, dumped when NCCL's
watchdog times out.
"""

from __future__ import annotations

import linecache
import os
import re
import signal
import sysconfig
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
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

_HEADER = "air_magic: stacks of pid {pid} ({role}), {why} at {clock}, most recent call first:"
_HEADER_RE = re.compile(r"^air_magic: stacks of pid (\d+) \((.*)\), (.*) at (\d\d:\d\d:\d\d), most recent call first:$")
_HEADER_START = "air_magic: stacks of pid "
_TRAILER = "air_magic: end of the stacks of pid {pid}"
_MARKS = (_HEADER_START, "air_magic: end of the stacks of pid ")
_TRAILER_RE = re.compile(r"^air_magic: end of the stacks of pid (\d+)$")
_THREAD_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) (?:\[(.*)\] )?\(most recent call first\):$")
_FRAME_RE = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')
_OTHER_DUMP_LINES = ("  <no Python frame>", "  ...", "  <truncated rest of calls>", "")

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


def request(ranks: Iterable[int], others: Iterable[int] = (), why: str = "on request", limit: float = REQUEST_LIMIT) -> int:
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


# -- reading dumps back ----------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def where(self) -> str:
        """'stuck_in_data_loading (/tmp/ipykernel_7/12.py, line 4)'."""
        return f"{self.function} ({self.file}, line {self.line})"

    def source(self) -> str:
        """The line of source, where this process can read it (a notebook's cells are in its linecache)."""
        return linecache.getline(self.file, self.line).strip() if self.line > 0 else ""


@dataclass
class ThreadStack:
    ident: str
    current: bool
    #: Outermost first, innermost last (the reverse of faulthandler's order).
    frames: list[Frame] = field(default_factory=list)
    name: str = ""

    def user_frame(self) -> Frame | None:
        """The innermost frame of user code: in the thread running the call, one the call led to; in a thread of
        air_magic's own (a rank before or after its call), one that air_magic called."""
        start = self._call_at()
        if start < 0:
            start = max((i for i, f in enumerate(self.frames) if _is_air_magic(f.file)), default=-1)
        return next((f for f in reversed(self.frames[start + 1 :]) if is_user_file(f.file)), None)

    def _call_at(self) -> int:
        """Index of air_magic's worker.run, which runs the call, on this stack; -1 if it is not there."""
        for i, f in enumerate(self.frames):
            if f.function == "run" and _is_air_magic(f.file) and f.file.endswith("worker.py"):
                return i
        return -1

    @property
    def runs_the_call(self) -> bool:
        """This thread runs the rank's call (air_magic's worker.run is on its stack)."""
        return self._call_at() >= 0


@dataclass
class Dump:
    """One process's stacks at one moment."""

    pid: int
    role: str
    why: str
    clock: str
    #: The thread running the call first, then threads in user code, then the rest.
    threads: list[ThreadStack] = field(default_factory=list)

    @property
    def of_rank(self) -> bool:
        return self.role == RANK_ROLE

    def user_frame(self) -> Frame | None:
        """The innermost frame of user code in the thread that runs the call (else in any thread)."""
        for thread in self.threads:
            frame = thread.user_frame()
            if frame is not None:
                return frame
        return None

    def summary(self) -> str:
        frame = self.user_frame()
        where = f"in {frame.where()}" if frame is not None else "in no user code"
        return f"pid {self.pid} ({self.role}), {self.why} at {self.clock}: {where}"

    def text(self) -> str:
        """Every thread, innermost frame last, each frame with its line of source where known."""
        out = [self.summary()]
        for thread in self.threads:
            label = "the call" if thread.runs_the_call else ("current" if thread.current else "")
            name = f" {thread.name}" if thread.name else ""
            out.append(f"  Thread {thread.ident}{name}{f' ({label})' if label else ''}:")
            if not thread.frames:
                out.append("    <no Python frame>")
            mark = thread.user_frame()
            for frame in thread.frames:
                line = f'    File "{frame.file}", line {frame.line}, in {frame.function}'
                if frame is mark:
                    line += "   <- innermost user frame"
                out.append(line)
                source = frame.source()
                if source:
                    out.append(f"      {source}")
        return "\n".join(out)


def _finish(dump: Dump, threads: list[ThreadStack]) -> Dump:
    # A rank that asks itself (a Ray rank's actor) sees its own asking thread in the dump: not worth showing.
    threads = [t for t in threads if not any(f.function == "request" and f.file.endswith(_SELF) for f in t.frames)]

    def order(t: ThreadStack) -> int:
        user = t.user_frame() is not None
        return 0 if t.runs_the_call else 1 if user and t.current else 2 if user else 3 if t.current else 4

    dump.threads = sorted(threads, key=order)
    return dump


class StackScanner:
    """Finds dumps in a rank's output as it arrives; `feed` gives back the rest of the text, and each dump once.

    In place of each dump's lines comes one line naming it, where its header was.
    """

    def __init__(self) -> None:
        self.pending = ""  # text held until it is known whether it starts or continues a dump
        self.dump: Dump | None = None
        self.threads: list[ThreadStack] = []
        self.dumps: list[Dump] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[Dump]]:
        """(text that is not part of a dump, dumps completed by this text)."""
        data = self.pending + text
        self.pending = ""
        out: list[str] = []
        done: list[Dump] = []
        while data:
            cut = data.find("\n")
            if cut < 0:
                if final:
                    out.append(self._line(data, done, partial=True))
                elif self.dump is not None or any(m.startswith(data) or data.startswith(m) for m in _MARKS):
                    self.pending = data
                else:
                    out.append(data)
                break
            line, data = data[:cut], data[cut + 1 :]
            out.append(self._line(line, done))
        if final and self.dump is not None:
            out.append(self._close(done))
        self.dumps += done
        return "".join(out), done

    def _line(self, line: str, done: list[Dump], partial: bool = False) -> str:
        """Consume one line; what of it to pass on (with its newline unless `partial`)."""
        end = "" if partial else "\n"
        if _TRAILER_RE.match(line):
            return self._close(done) if self.dump is not None else ""  # after output that came in between too
        head = _HEADER_RE.match(line)
        if head is not None:
            closed = self._close(done) if self.dump is not None else ""
            self.dump = Dump(int(head[1]), head[2], head[3], head[4])
            return closed
        if self.dump is not None:
            thread = _THREAD_RE.match(line)
            if thread is not None:
                self.threads.append(ThreadStack(thread[2], thread[1] == "Current thread", name=thread[3] or ""))
                return ""
            frame = _FRAME_RE.match(line)
            if frame is not None and self.threads:
                number = int(frame[2]) if frame[2].isdigit() else 0
                self.threads[-1].frames.insert(0, Frame(frame[1], number, frame[3]))
                return ""
            if line in _OTHER_DUMP_LINES:
                return ""
            return self._close(done) + line + end
        return line + end

    def _close(self, done: list[Dump]) -> str:
        """End the dump being read; the line shown in its place."""
        assert self.dump is not None
        dump = _finish(self.dump, self.threads)
        self.dump, self.threads = None, []
        done.append(dump)
        return f"[{dump.summary()}; every thread in the log]\n"


def parse(text: str) -> list[Dump]:
    """Every dump in a log's text, oldest first."""
    scanner = StackScanner()
    scanner.feed(text, final=True)
    return scanner.dumps


def last_rank_dump(log: Path, why: str = STOPPING, max_bytes: int = 1 << 20) -> Dump | None:
    """The newest dump of the rank's own process, asked for `why`, in its log file (read from its last `max_bytes`)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    found = [d for d in parse(text) if d.of_rank and d.why == why]
    return found[-1] if found else None


def where_ranks_were(logs: list[Path]) -> str | None:
    """One line per rank: the innermost frame of user code its last dump shows; None if no rank left a dump."""
    dumps = [last_rank_dump(log) for log in logs]
    if not any(dumps):
        return None
    lines = []
    for rank, dump in enumerate(dumps):
        if dump is None:
            lines.append(f"  rank {rank}: no stacks (it had ended, or did not answer)")
            continue
        frame = dump.user_frame()
        lines.append(f"  rank {rank}: in {frame.where()}" if frame else f"  rank {rank}: in no user code")
    return "Where each rank was when it was stopped (every thread's stack is in its log):\n" + "\n".join(lines)


# -- which frames are the user's -------------------------------------------------------
_PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep
_SELF = os.path.join("air_magic", "launch", "stacks.py")
_LIBRARY_DIRS = tuple(
    {p + os.sep for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")) if p}
)
_LIBRARY_RE = re.compile(r"/(site|dist)-packages/|/lib/python3\.\d+/|/air_magic/launch/")


def _is_air_magic(file: str) -> bool:
    return file.startswith(_PACKAGE) or "/air_magic/" in file


def is_user_file(file: str) -> bool:
    """Code the user wrote: not the standard library, an installed package, air_magic or frozen bootstrap code."""
    if file.startswith(("<frozen", _PACKAGE, *_LIBRARY_DIRS)):
        return False
    return _LIBRARY_RE.search(file) is None


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
