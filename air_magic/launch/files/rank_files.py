"""What a rank left in the call's run directory, read the same way by every launcher.

A rank's log file is the loss-free record of its output: `LogTail` follows it
and decodes it into text for `RankOutput` events (the local launcher's ranks
write it themselves; the Ray launcher appends what each node sends). Once a
rank has exited, `outcome` reads its result or error file into the
`RankOutcome` of its `RankExited`. `write_usage` / `read_usage` keep what a
rank on another node uses, as its node sampled it. This module starts nothing.
"""

from __future__ import annotations

import codecs
import os
import time
from pathlib import Path

from .. import protocol as p
from .errorfile import read_error_file
from .rundir import RunDir

_READ_CHUNK = 1 << 20


class LogTail:
    """Follows one rank's log file from its end when made (what an earlier attempt wrote is not read again), or,
    `from_start`, from its first byte (a panel drawn again, a command line that follows a call)."""

    def __init__(self, path: Path, from_start: bool = False) -> None:
        self.path = path
        try:
            self.offset = 0 if from_start else path.stat().st_size
        except OSError:
            self.offset = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read(self, final: bool = False) -> str:
        """Text written since the last read (at most a chunk); `final`: the end of the file is the end of the log."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(_READ_CHUNK)
        except OSError:
            data = b""
        self.offset += len(data)
        return self.decoder.decode(data, final=final and len(data) < _READ_CHUNK)

    def read_all(self, final: bool = False) -> list[str]:
        """Every piece of text written since the last read."""
        found: list[str] = []
        while True:
            text = self.read(final)
            if text:
                found.append(text)
            if not text:
                return found


def write_usage(path: Path, usage: tuple[float, int]) -> None:
    """Keep what a rank on another node uses now (its node sampled it): CPU % and resident bytes."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{usage[0]:.1f} {int(usage[1])}\n")
    os.replace(tmp, path)


def read_usage(path: Path, fresh: float = 5.0) -> tuple[float, int] | None:
    """What `write_usage` kept, if it was written in the last `fresh` seconds (a rank that ended sends none)."""
    try:
        if time.time() - path.stat().st_mtime > fresh:
            return None
        cpu, memory = path.read_text().split()
        return float(cpu), int(memory)
    except (OSError, ValueError):
        return None


def outcome(run_dir: RunDir, rank: int, error_at: float | None = None) -> p.RankOutcome:
    """The result or the error a rank left in the run directory (`error_at`: when the error was written, if the
    error file's own time is not that, as for a file copied from another node)."""
    error = read_error_file(run_dir.error(rank), run_dir.error_pickle(rank), rank)
    if error is not None:
        if error_at is None:
            try:
                error_at = run_dir.error(rank).stat().st_mtime_ns / 1e9
            except OSError:
                error_at = None
        return p.RankOutcome(error=error, error_at=error_at)
    try:
        return p.RankOutcome(value=run_dir.result(rank).read_bytes())
    except OSError:
        return p.RankOutcome()
