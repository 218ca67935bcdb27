"""The table of this process's calls: every call it makes, foreground or background, with its id and its handle.

One table per process that makes calls (its owner's, air_magic/owner/): a kernel, a command-line run, a detached
call's owner. It imports no
IPython and starts nothing. A call is added when it is made (`add`) and said ended when it ends (`ended`); it is
found one way, `find`, by

- its id: its run directory's name (unique on the machine), or a unique start of it, or the directory's path;
- its small number in this process (1, 2, ...), the shortcut `%distributed_calls` shows.

Sessions ("is this session busy?"), the ledger's holders, `%distributed_calls`, `%distributed_stop`,
`%distributed_show` and `%distributed_debug` read it; nothing else keeps a record of the calls running here.
A call is anything with the `Call` shape (handle.DistributedCall is the one handle). Not for: calls of
other processes (record.py reads those from disk), or running a call (handle.py, sessions.py).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ..errors import ConfigurationError

__all__ = ["Call", "CallTable", "UnknownCall"]


class Call(Protocol):
    """What the table and its readers read of a call: its small number, its run directory once made (a wait for
    it), its session and ranks, whether it ended."""

    number: int

    @property
    def run_dir_name(self) -> str | None: ...

    @property
    def run_dir(self) -> Path: ...

    def has_run_dir(self, timeout: float | None = ...) -> bool: ...

    @property
    def session(self) -> str | None: ...

    @property
    def world_size(self) -> int: ...

    def done(self) -> bool: ...


class UnknownCall(ConfigurationError, LookupError):
    """No call, or more than one, answers to what was asked."""


class CallTable:
    """Every call of one process by small number, oldest first; thread-safe.

    `add(call)` gives it its number; `find(id)` finds it; `all()` lists them; `ended(call)` tells whoever asked
    with `on_end(fn)` that it ended.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._calls: dict[int, Call] = {}
        self._on_end: list[Callable[[Call], None]] = []

    def add(self, call: Call) -> int:
        """Record `call` and give it its small number (set on `call.number`, and returned)."""
        with self._lock:
            call.number = next(self._numbers)
            self._calls[call.number] = call
        return call.number

    def all(self) -> list[Call]:
        """Every call, oldest first."""
        with self._lock:
            return list(self._calls.values())

    def running(self) -> list[Call]:
        """The calls not ended yet, oldest first."""
        return [call for call in self.all() if not call.done()]

    def in_session(self, session: str, but: Call | None = None) -> Call | None:
        """The call running in `session` now (other than `but`), if any: the session is busy with it."""
        for call in self.running():
            if call is not but and call.session == session:
                return call
        return None

    def check_free(self, session: str | None, call: Call | None = None) -> None:
        """Refuse a call into `session` while another call (not `call`) runs in it, naming that call."""
        running = self.in_session(session, but=call) if session is not None else None
        if running is not None:
            describe = getattr(running, "describe", None)
            said = describe() if callable(describe) else f"call {running.number}"
            raise ConfigurationError(SESSION_BUSY.format(session=session, call=said))

    def find(self, ident: str | int | None = None) -> Call:
        """The call `ident` names: its small number, its id (the run directory's name) or a unique start of it, or
        its run directory's path; None: the latest call. UnknownCall, saying which calls there are, otherwise."""
        calls = self.all()
        if ident is None:
            if calls:
                return calls[-1]
            raise UnknownCall(f"there is no call in this process yet; {_KNOWN_NONE}")
        text = str(ident).strip()
        if text.isdigit():
            for call in calls:
                if call.number == int(text):
                    return call
        name = Path(text).name if "/" in text else text
        exact = [call for call in calls if call.run_dir_name == name]
        found = exact or [call for call in calls if call.run_dir_name and call.run_dir_name.startswith(name)]
        if len(found) == 1:
            return found[0]
        if found:
            names = ", ".join(f"{call.number} ({call.run_dir_name})" for call in found)
            raise UnknownCall(f"{text!r} names {len(found)} calls: {names}; give more of the id, or the number.")
        raise UnknownCall(f"there is no call {text} in this process; known calls: {self.known()}.")

    def known(self) -> str:
        """The calls' numbers, for an error (%distributed_calls lists their ids)."""
        calls = self.all()
        return ", ".join(str(call.number) for call in calls) if calls else _KNOWN_NONE

    def on_end(self, listener: Callable[[Call], None]) -> None:
        """Call `listener(call)` whenever a call of this table ends (on the thread that ended it)."""
        with self._lock:
            self._on_end.append(listener)

    def ended(self, call: Call) -> None:
        """`call` ended: tell those who asked (`on_end`); a listener that raises changes nothing."""
        with self._lock:
            listeners = list(self._on_end)
        for listener in listeners:
            try:
                listener(call)
            except Exception:  # noqa: BLE001, S112 - a listener never changes the call
                continue


#: What a call into a session that another call runs in is told.
SESSION_BUSY = (
    "session {session!r} is busy: {call} runs in it. Wait for it (`handle.result()`, or %distributed_calls to see "
    "it), or cancel it, then run this call again."
)
_KNOWN_NONE = "none yet (start one with fn.spawn(...) or %%distributed --background)"
