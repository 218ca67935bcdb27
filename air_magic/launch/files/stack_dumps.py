"""Reading back the stacks ranks write to their logs (stacks.py asks for them): where each rank was.

`StackScanner` finds the dumps in a rank's output as it arrives, and `parse` in
a whole log. A `Dump` reads like a traceback: in each thread the outermost
frame first and the innermost last, the thread running the call (user code)
first; `Dump.user_frame` is the innermost frame of user code, the frame the
timeout and cancel errors name (`where_ranks_were`). `death_tail` is the tail of
a rank that died of a fatal signal, its faulthandler dump kept short.

Over 300 lines because it is the one reader of what faulthandler writes into a
rank's log, asked-for stacks and fatal-error dumps alike.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from ..native_frames import NATIVE_MARK, NATIVE_RE, NO_NATIVE_RE
from ..stacks import HEADER_RE, MARKS, RANK_ROLE, STOPPING, TRAILER_RE

_THREAD_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) (?:\[(.*)\] )?\(most recent call first\):$")
_FRAME_RE = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')
_MARK = "air_magic: "
_OTHER_DUMP_LINES = ("  <no Python frame>", "  ...", "  <truncated rest of calls>", "")


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
    #: py-spy's view of the process, native frames included (a rank's own process), as py-spy wrote it.
    native: list[str] = field(default_factory=list)
    #: Why there are no native frames, when py-spy could not give them.
    native_note: str | None = None

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
        if self.native:
            out.append("  Native frames too (py-spy dump --native), innermost first:")
            out += [f"    {line}" for line in self.native]
        elif self.native_note:
            out.append(f"  No native frames: {self.native_note}")
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
        if self.dump is None and not self.pending and _MARK not in text:
            # Most output holds no dump: pass it on in one piece (a flood must not be read line by line here).
            cut = text.rfind("\n") + 1
            if final or not any(m.startswith(text[cut:]) for m in MARKS) or cut == len(text):
                return text, []
            self.pending = text[cut:]  # a line that may yet become a header
            return text[:cut], []
        data = self.pending + text
        self.pending = ""
        out: list[str] = []
        done: list[Dump] = []
        while data:
            cut = data.find("\n")
            if cut < 0:
                if final:
                    out.append(self._line(data, done, partial=True))
                elif self.dump is not None or any(m.startswith(data) or data.startswith(m) for m in MARKS):
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
        if TRAILER_RE.match(line):
            return self._close(done) if self.dump is not None else ""  # after output that came in between too
        head = HEADER_RE.match(line)
        if head is not None:
            closed = self._close(done) if self.dump is not None else ""
            self.dump = Dump(int(head[1]), head[2], head[3], head[4])
            return closed
        if self.dump is not None:
            if line.startswith(NATIVE_MARK):
                self.dump.native.append(line[len(NATIVE_MARK) :])
                return ""
            if NATIVE_RE.match(line):
                return ""
            no_native = NO_NATIVE_RE.match(line)
            if no_native is not None:
                self.dump.native_note = no_native[2]
                return ""
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


#: How faulthandler begins what it writes when the process dies of a fatal signal (SIGSEGV, SIGABRT, ...).
_FATAL = "Fatal Python error: "


def compact_fatal_dump(lines: list[str]) -> list[str]:
    """A dying rank's last lines with faulthandler's fatal-error dump shortened to its header and the thread that
    died: the other threads' stacks (air_magic's own daemon threads among them) and the list of extension modules
    would push the rank's last output out of a short tail. They stay in the full log."""
    start = max((i for i, line in enumerate(lines) if line.startswith(_FATAL)), default=-1)
    if start < 0:
        return lines
    kept, others, block = lines[:start], 0, "header"
    for line in lines[start:]:
        thread = _THREAD_RE.match(line)
        if thread is not None:
            block = "current" if thread.group(1) == "Current thread" else "other"
            others += block == "other"
        elif line.startswith("Extension modules:"):
            block = "other"
            continue
        if block != "other":
            kept.append(line)
    if others:
        kept.append(f"(the stacks of {others} other thread(s) are in the full log)")
    return kept


def death_tail(log: Path, lines: int = 20, max_bytes: int = 64 * 1024) -> str:
    """The last `lines` lines of a rank's log after it died, its fatal-error dump kept short (compact_fatal_dump)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", errors="replace").replace("\r", "\n")
    except OSError:
        return ""
    return "\n".join(compact_fatal_dump(text.splitlines())[-lines:])


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
