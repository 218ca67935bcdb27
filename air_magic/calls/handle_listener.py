"""The listener a call's handle puts first among its call's listeners: it tells the handle what the runner does (the
call's context at its start, its result at its end) and passes every hook on to the panels drawn again for the call
(display/follow.py), none of which can change the call.

Not for the handle itself (handle.py) nor for drawing anything (display/).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from ..job import JobResult, RankState
from ..listeners import Listener, RunContext


class Handle(Protocol):
    """What the listener tells: a call's handle (handle.DistributedCall)."""

    result_: JobResult | None

    def began(self, ctx: RunContext) -> None: ...


class HandleListener(Listener):
    """Tells the handle what the runner does, and passes it on to the panels drawn again (`follow`)."""

    def __init__(self, call: Handle) -> None:
        self.call = call
        self.followers: list[Listener] = []
        self.states: dict[int, RankState] = {}
        self.lock = threading.Lock()

    def on_start(self, ctx: RunContext) -> None:
        self.call.began(ctx)

    def _each(self, hook: str, *args: Any) -> None:
        with self.lock:
            followers = list(self.followers)
        for follower in followers:
            try:
                getattr(follower, hook)(*args)
            except Exception:  # noqa: BLE001, S112 - a second view never changes the call
                continue

    def on_phase(self, phase: Any) -> None:
        self._each("on_phase", phase)

    def on_rank_state(self, rank: int, state: RankState) -> None:
        self.states[rank] = state
        self._each("on_rank_state", rank, state)

    def on_attempt(self, attempt: int, why: str) -> None:
        self._each("on_attempt", attempt, why)

    def poll(self) -> None:
        self._each("poll")

    def on_end(self, result: JobResult) -> None:
        self.call.result_ = result
        self._each("on_end", result)
