"""A hot rank's loop, the same for both launchers: say a call ended, wait for the next one, run it.

A hot rank (one of a kept world) serves one call after another until a call fails in a way that makes it unfit for more
or it is released. `serve` is that loop and what the rank does between calls (its hooks reset, a tidy-up while it
waits); a `Transport` carries the rest: the helper's pipes for a local rank (`Pipes`, here), the actor's methods for
a Ray rank (launch/ray/rank.py). Not for running one call (worker.py, handed to the loop as `Calls`) nor for
deciding what a failed call leaves (session.ends_session, and the keeper on the notebook's side).
"""

from __future__ import annotations

import gc
import os
import select
import sys
from pathlib import Path
from typing import Protocol

from ..files.rundir import RunDir
from ..protocol import TOOK, HotCall, decode

#: A local hot rank idle this long after a call collects garbage and empties the CUDA cache.
TIDY_AFTER = 0.2


class Calls(Protocol):
    """What runs each call in the rank: worker.py, the module itself."""

    #: The last call failed in a session's user code and left the rank usable.
    session_kept: bool

    def run(self, path: Path, rank: int) -> int:
        """Run the call of the run directory `path` as `rank`; the exit code."""
        ...

    def end_call(self) -> None:
        """The call is over: hooks send what they hold, output is flushed."""
        ...


class Transport(Protocol):
    """How a hot rank hears of its next call and says a call ended."""

    #: Seconds without a next call after which the rank tidies up (a call arriving meanwhile waits for it).
    tidy_after: float

    def report(self, code: int, kept: bool) -> bool:
        """Say the call ended with `code` (`kept`: it failed and the rank stays usable); False: no one listens."""
        ...

    def ready(self, timeout: float) -> bool:
        """The next call (or the release) came within `timeout` seconds."""
        ...

    def take(self) -> Path | None:
        """Wait for the next call and ready the process for it; its run directory, or None: released."""
        ...


def serve(code: int, rank: int, transport: Transport, calls: Calls) -> int:
    """After a first call that ended with `code`, run the calls `transport` brings until one fails and leaves the rank
    unusable (its code is returned) or the rank is released (0)."""
    while code == 0 or calls.session_kept:
        calls.end_call()
        if not transport.report(code, code != 0):
            return 0  # no one listens any more
        if not transport.ready(transport.tidy_after):
            tidy()  # no call right away: tidy up while waiting, so a quick re-run does not wait for it
        path = transport.take()
        if path is None:
            return 0
        code = calls.run(path, rank)
    return code


def tidy() -> None:
    """While a hot rank waits for the next call: collect garbage and empty the CUDA cache."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class Pipes:
    """A local hot rank's transport: the helper writes each `HotCall` on the command pipe and reads "<code>" (or
    "<code> kept") on the done pipe (launch/local/pool.py), after "took" as a session call's user code starts;
    end-of-file on the command pipe releases the rank."""

    tidy_after = TIDY_AFTER

    def __init__(self, fds: str, rank: int) -> None:
        self.cmd, self.done = (int(fd) for fd in fds.split(","))
        self.rank = rank

    def report(self, code: int, kept: bool) -> bool:
        try:
            os.write(self.done, b"0\n" if code == 0 else f"{code} kept\n".encode())
        except OSError:
            return False  # the supervisor is gone
        return True

    def took(self) -> None:
        """Say a session call's user code starts, where a SIGINT raises KeyboardInterrupt: the supervisor interrupts
        the rank only then."""
        try:
            os.write(self.done, TOOK + b"\n")
        except OSError:
            pass  # the supervisor is gone

    def ready(self, timeout: float) -> bool:
        return bool(select.select([self.cmd], [], [], timeout)[0])

    def take(self) -> Path | None:
        line = _read_line(self.cmd)
        if not line:
            return None  # released: end-of-file on the command pipe
        message = decode(line)
        assert isinstance(message, HotCall), message
        os.environ.clear()
        os.environ.update(message.env)
        run_dir = RunDir(Path(message.run_dir))
        log = os.open(run_dir.log(self.rank), os.O_WRONLY | os.O_APPEND)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        return run_dir.path


def _read_line(fd: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            return b""
        data += chunk
    return data
