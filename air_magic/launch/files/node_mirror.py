"""A command run's node files, sent back from a node whose rank has a directory of its own (a Ray actor's scratch).

A command run's node writes, in its run directory, each attempt's node log with its time index and how the node
ended, the directory of the ranks its launcher started (their logs, info, step times, usage and stacks:
cli/command_rank.py) and the alerts it raised (command_logs.py names them). Locally that directory is the call's
own; on Ray it is the rank actor's scratch on its node, so `Mirror` reads what changed there at each poll and
`apply` writes it into the call's run directory on the caller's machine, under the same names: `get`, `logs
--rank/--node`, `stacks` and the panel's rank tabs read them as they read a local node's.

Files that only grow (logs, time indexes, stacks, alerts) travel as the bytes appended since the last look, the
others (small JSON, replaced whole by their writer) whole when they changed. A `.jsonl` file travels in whole
lines only, as each node's lines are appended to one file here. Not regular files (a debugger's FIFOs) and
`.tmp` files (a replacement half written) never travel. Nothing here starts a process or knows Ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .command_logs import TRAVELLING
from .rundir import write_private

#: Names that end so are appended to, never rewritten.
APPENDED = (".log", ".times", ".stacks", ".jsonl")
#: Bytes of one file sent in one look at most (the rest goes with the next).
CHUNK = 1 << 20


@dataclass(frozen=True)
class Change:
    """What changed in one file: its path under the run directory, and its new bytes (`appended`, or the whole)."""

    name: str
    data: bytes
    appended: bool


class Mirror:
    """Remembers what was sent of each file under `root` (the node's run directory on its own machine)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.sent: dict[str, tuple[int, int, int]] = {}  # name -> (inode, size, mtime_ns) when last sent
        self.more = False  # a file had more than CHUNK to send

    def changes(self) -> list[Change]:
        """What changed since the last call, at most CHUNK bytes a file (`more` says whether some is left)."""
        self.more = False
        found = []
        for path in self._files():
            name = path.relative_to(self.root).as_posix()
            try:
                st = path.stat()
            except OSError:
                continue
            seen = self.sent.get(name)
            if seen == (st.st_ino, st.st_size, st.st_mtime_ns):
                continue
            change = self._read(path, name, seen, st)
            if change is not None:
                found.append(change)
        return found

    def _files(self) -> list[Path]:
        out: list[Path] = []
        for top in TRAVELLING:
            path = self.root / top
            if path.is_file():
                out.append(path)
            elif path.is_dir():
                out += sorted(p for p in path.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))
        return out

    def _read(self, path: Path, name: str, seen: tuple[int, int, int] | None, st: os.stat_result) -> Change | None:
        appended = path.name.endswith(APPENDED)
        start = seen[1] if appended and seen is not None and seen[0] == st.st_ino else 0
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(CHUNK if appended else -1)
        except OSError:
            return None
        if appended and name.endswith(".jsonl"):
            data = data[: data.rfind(b"\n") + 1]  # whole lines: another node's are appended to the same file
        if appended and start + len(data) < st.st_size:
            self.more = True
        if appended and not data:
            return None
        self.sent[name] = (st.st_ino, start + len(data) if appended else st.st_size, st.st_mtime_ns)
        return Change(name, data, appended and start > 0)


def apply(run_dir: Path, changes: list[Change] | tuple[Change, ...]) -> None:
    """Write what a node sent into the call's run directory `run_dir`, under the same names (0600). A file that
    grows is written in place (a reader that holds it open, as `air-magic stacks` does, sees it grow); a `.jsonl`
    file is appended to whatever the run's other nodes sent."""
    root = Path(run_dir).resolve()
    for change in changes:
        path = (root / change.name).resolve()
        if root not in path.parents:
            continue  # only names under the run directory
        path.parent.mkdir(parents=True, exist_ok=True)
        if change.appended or change.name.endswith(".jsonl"):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, change.data)
            finally:
                os.close(fd)
        elif path.name.endswith(APPENDED):
            write_private(path, change.data, exclusive=False)  # its first bytes: in place
        else:
            tmp = path.with_name(path.name + ".tmp")
            write_private(tmp, change.data, exclusive=False)
            os.replace(tmp, path)
