"""How a session call takes Ctrl-C on a rank, for both launchers: an interrupt is raised in the user's code, never
lost while the call loads, and never carried into the next call.

A session's rank ignores SIGINT between calls (as the supervisor it was forked from does). In a local rank the call
runs in the main thread: `expect` arms a handler that keeps a SIGINT for the call, and `run_in_session` raises a
kept one as the user's code starts and lets the next ones raise KeyboardInterrupt in it. As that code starts, the
rank says "took" on its hot pipes (`pipes`): the supervisor sends no SIGINT before it reads that
(launch/local/supervisor.py), since one sent between calls would be lost, and a rank's short time to come back
counts from a SIGINT that reached its code. A Ray rank's call runs in another thread, which no signal reaches: its actor
calls `expect_in_thread` when it is handed the call, and `interrupt_call` raises KeyboardInterrupt in that thread
while the user's code runs there (`interruptible`), or keeps it for that code while the call still loads.

Runs in the worker; imports no IPython and no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .hot import Pipes

T = TypeVar("T")

#: A local hot rank's pipes to the supervisor (set by worker.run_forked): a session call says "took" on them.
pipes: Pipes | None = None
#: A SIGINT reached this session call (main thread) before its user code started: raised as that code starts.
_interrupted_early = False

#: Guards `_user_thread` and `_pending`: an interrupt lands only in the user's code.
_interrupt_lock = threading.Lock()
#: The thread running a session call's user code now, where a signal cannot reach it (a Ray actor's call thread).
_user_thread: int | None = None
#: A call was handed to this rank (`expect_in_thread`) and its user code is not running yet: False, or True once an
#: interrupt came meanwhile (raised as that code starts); None when no call waits.
_pending: bool | None = None


def _note_early_interrupt(signum: int, frame: object) -> None:
    global _interrupted_early
    _interrupted_early = True


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def expect(session: bool) -> None:
    """A call starts in the main thread: if it is a session's, a SIGINT from now on is for it (kept until its user
    code runs, then raised there)."""
    global _interrupted_early
    _interrupted_early = False
    if session and _on_main_thread():
        signal.signal(signal.SIGINT, _note_early_interrupt)


def run_in_session(code: Callable[[], T]) -> T:
    """Run a session call's user `code` with Ctrl-C live: KeyboardInterrupt is raised in it (an early one as it
    starts); afterwards SIGINT is ignored again, so a late one lands in no later call. A local hot rank says "took"
    as its code starts: the supervisor interrupts it from then on, and gives it its short time to come back."""
    if not _on_main_thread():
        with interruptible():
            return code()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if pipes is not None:
            pipes.took()
        if _interrupted_early:
            raise KeyboardInterrupt
        return code()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _async_raise(thread: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in `thread` at its next Python line (None: cancel one not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(exc) if exc else None)


def expect_in_thread() -> None:
    """A session call was handed to this (Ray) rank: an interrupt before its user code runs is kept for it."""
    global _pending
    with _interrupt_lock:
        _pending = False


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """The user's code of a session call runs in this (non-main) thread: `interrupt_call` may raise in it.

    An interrupt that came while the call loaded is raised at once. On the way out an interrupt not raised yet is
    cancelled, so none lands in what follows the call (writing its result); one raised on the way out is raised
    here, inside the call, and reported as its error.
    """
    global _user_thread, _pending
    me = threading.get_ident()
    with _interrupt_lock:
        _user_thread, early, _pending = me, _pending, None
    try:
        if early:
            raise KeyboardInterrupt
        yield
    finally:
        with _interrupt_lock:
            _user_thread = None
            _async_raise(me, None)


def interrupt_call() -> bool:
    """KeyboardInterrupt in the session call running in another thread of this process: True if raised in its user
    code now; False if kept for it while it loads (`expect_in_thread`), or if none runs."""
    global _pending
    with _interrupt_lock:
        if _user_thread is None:
            if _pending is not None:
                _pending = True
            return False
        _async_raise(_user_thread, KeyboardInterrupt)
        return True
