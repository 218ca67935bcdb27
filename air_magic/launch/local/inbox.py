"""The supervisor's requests: read from its stdin as they come, kept in order until the supervisor handles them.

The supervisor's loop reads with `read()` when select says stdin is readable. A background preparation
(preload.py) asks `must_give_way` at each module it loads: requests that only add preparations (PrepareHooks)
are taken meanwhile and never interrupt it, and a launch whose ranks need the preparation under way lets
it finish, since the launch would wait for it anyway and, interrupted, its work would be rolled back and
done again. Any other request interrupts it.
"""

from __future__ import annotations

import os
import select
from collections import deque
from collections.abc import Callable
from pathlib import Path

from .. import protocol as p
from ..files.rundir import RunDir


class Inbox:
    """Requests read from `fd` (one JSON line each) and not yet handled; `eof` once the kernel closed the pipe."""

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        self.queue: deque[p.Message] = deque()
        self.eof = False
        self._partial = b""
        self._needs: dict[str, list[str]] = {}  # a waiting launch's job id -> the preparations its ranks need

    def readable(self) -> bool:
        return not self.eof and bool(select.select([self.fd], [], [], 0)[0])

    def read(self) -> None:
        """Take what the pipe holds now (call when it is readable)."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.eof = True
            return
        self._partial += chunk
        while b"\n" in self._partial:
            line, self._partial = self._partial.split(b"\n", 1)
            if line.strip():
                self.queue.append(p.decode(line))

    def next(self) -> p.Message | None:
        if not self.queue:
            return None
        msg = self.queue.popleft()
        if isinstance(msg, p.LaunchJob):
            self._needs.pop(msg.job, None)
        return msg

    def must_give_way(
        self, preparing: str, take: Callable[[p.Message], None], needed_by: Callable[[Path], list[str]]
    ) -> bool:
        """Whether a waiting request must interrupt the preparation of hook module `preparing`.

        PrepareHooks requests are handed to `take` at once; `needed_by(payload)` names the preparations a
        launch's ranks need.
        """
        if self.readable():
            self.read()
        if self.eof:
            return True
        for asked in [m for m in self.queue if isinstance(m, p.PrepareHooks)]:
            self.queue.remove(asked)
            take(asked)
        for msg in self.queue:
            if not isinstance(msg, p.LaunchJob):
                return True
            if msg.job not in self._needs:
                self._needs[msg.job] = needed_by(RunDir(Path(msg.run_dir)).payload)
            if preparing not in self._needs[msg.job]:
                return True
        return False
