"""Machine-wide leases of GPUs and CPU slots: one lock file per unit, held by the process whose call uses it.

Every process of this user on the machine that runs calls (a kernel, a command-line run, a detached call)
leases its units here, so two of them never share a GPU. A unit is leased by `fcntl.flock` on a descriptor
the holding process keeps open: the kernel drops the lock when that process ends, however it ends
(`kill -9` included), so a lease never outlives its holder and no file has to be cleaned up. Beside each lock
is a small holder file (pid, which kind of process, the call's id and name) so that a waiting call can say
who holds what; it is only read while the lock is held, so a stale one is never believed.

The files live in a private directory (0700) beside the run directories (`<runs root>/.leases`), so
processes that share a runs root share leases. Descriptors are opened close-on-exec, so a child process
never keeps a lease alive. Not for: the order in which the calls of one process queue (ledger.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..launch.files.rundir import runs_root


def lease_dir() -> Path:
    """The private directory of this user's lock files (made 0700 on first use)."""
    path = runs_root() / ".leases"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _safe(unit: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in unit)[:80]


@dataclass
class Lease:
    """One unit held by this process: its open, locked descriptor."""

    kind: str
    unit: str
    fd: int

    def release(self, directory: Path) -> None:
        with contextlib.suppress(OSError):
            (directory / f"{self.kind.lower()}-{_safe(self.unit)}.holder").unlink()
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(self.fd)


class Leases:
    """The lock files of one directory, held by this process; `role()` says what kind of process it is, as a
    waiting call names the holder: "kernel", "cli" or "detached" (its owner's role)."""

    def __init__(self, directory: Path, role: Callable[[], str] = lambda: "kernel") -> None:
        self.directory = directory
        self.role = role

    def _lock_path(self, kind: str, unit: str) -> Path:
        return self.directory / f"{kind.lower()}-{_safe(unit)}.lock"

    def _holder_path(self, kind: str, unit: str) -> Path:
        return self.directory / f"{kind.lower()}-{_safe(unit)}.holder"

    def try_lease(self, kind: str, unit: str, label: str) -> Lease | None:
        """Lock `unit` for this process now (None if another holder has it) and say who holds it."""
        fd = os.open(self._lock_path(kind, unit), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        self._write_holder(kind, unit, label)
        return Lease(kind, unit, fd)

    def _write_holder(self, kind: str, unit: str, label: str, yields: bool = False) -> None:
        """The holder file of `unit`: this process (pid, kind) and what holds the unit in it (a call, by its id, or
        a kept world and the call that made it); `yields`: idle hot ranks, which end when another process asks."""
        info = {"pid": os.getpid(), "role": self.role(), "label": label, "yields": yields}
        holder = self._holder_path(kind, unit)
        with contextlib.suppress(OSError):
            tmp = holder.with_suffix(f".tmp{os.getpid()}")
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(out, "w") as f:
                f.write(json.dumps(info))
            tmp.replace(holder)

    def relabel(self, leases: list[Lease], label: str, yields: bool = False) -> None:
        """These units, still locked by this process, are held by `label` from now on (`yields`: by idle hot ranks,
        which another process may ask to end)."""
        for lease in leases:
            self._write_holder(lease.kind, lease.unit, label, yields)

    def lease_all(self, kind: str, units: list[str], want: int, label: str) -> list[Lease] | None:
        """`want` of `units` locked for this process, or None (and nothing kept) if fewer are free."""
        got: list[Lease] = []
        for unit in units:
            if len(got) == want:
                break
            lease = self.try_lease(kind, unit, label)
            if lease is not None:
                got.append(lease)
        if len(got) < want:
            self.release(got)
            return None
        return got

    def release(self, leases: list[Lease]) -> None:
        for lease in leases:
            lease.release(self.directory)

    def holder_info(self, kind: str, unit: str) -> dict[str, Any] | None:
        """What the holder file of `unit` says (pid, role, label, yields) while another descriptor holds its lock;
        {} if it is held and the file cannot be read; None if it is free."""
        path = self._lock_path(kind, unit)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            try:
                info = json.loads(self._holder_path(kind, unit).read_text())
                return info if isinstance(info, dict) else {}
            except (OSError, ValueError):
                return {}
        finally:
            os.close(fd)
        return None

    def holder(self, kind: str, unit: str) -> str | None:
        """Who holds `unit` in another process ("call 3 (train), kernel pid 42"), None if it is free."""
        info = self.holder_info(kind, unit)
        if info is None:
            return None
        if not info:
            return "another process"
        return f"{info.get('label') or 'a call'} ({info.get('role', 'process')} pid {info.get('pid')})"

    # -- asking another process's idle hot ranks to end ------------------------------------------------------
    def _yield_path(self, pid: int) -> Path:
        return self.directory / f"yield-{int(pid)}"

    def ask_to_yield(self, pid: int, asker: str) -> None:
        """Ask process `pid` to end its idle hot ranks (their units are wanted by `asker`)."""
        with contextlib.suppress(OSError):
            tmp = self.directory / f".yield-{int(pid)}.{os.getpid()}.tmp"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(out, "w") as f:
                f.write(asker)
            tmp.replace(self._yield_path(pid))

    def yield_asked(self) -> str | None:
        """Whether another process asked this one to end its idle hot ranks: who asked (the request is taken)."""
        path = self._yield_path(os.getpid())
        try:
            asker = path.read_text()
        except OSError:
            return None
        path.unlink(missing_ok=True)
        return asker or "another process"
