"""Debuggers of ranks, as the notebook serves them: prompts answered in the cell, attaching, post-mortems.

A rank stopped at `breakpoint()` waits at a prompt written to the call's run
directory (launch/files/debug_channel.py, launch/rank/debugger.py). `DebugServer`
is what the runner's wait loop asks, in a foreground call: it prints what the
rank's debugger printed and asks for the next command with `input()`, which in
a Jupyter kernel is the standard input request of the running cell. Prompts of
several ranks are served one after the other, and a rank being stepped keeps
the turn for a moment after each answer, so its prompts do not interleave with
another rank's. The time spent at a prompt is handed back so that the call's
timeout does not count it.

`attach(run_dir, rank)` does the same from another cell, for a call whose
runner cannot ask (a background call); `sessions.post_mortem(session, rank)` opens the
debugger on the error a session's rank kept. `%distributed_debug` (magics/debug.py)
is the IPython door to both. No IPython here: `input()` is whatever the
process has (the kernel's, a terminal's).
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import AirMagicError, ConfigurationError
from ..launch.files import debug_channel
from ..launch.files.debug_channel import Prompt
from ..launch.files.rundir import RunDir
from .table import CallTable

#: Seconds a rank being stepped keeps the turn after an answer, before another rank's prompt is served.
FOCUS = 2.0
_POLL = 0.05

NO_STDIN = (
    "air_magic: rank {rank} stopped in its debugger at {where}, but this frontend cannot answer input requests "
    "(nbclient and nbconvert run without them), so it continues (`c`). Run the cell in JupyterLab, Notebook or a "
    "terminal to debug, or set PYTHONBREAKPOINT=0 to skip breakpoint() calls."
)
NOT_IN_SESSION = (
    "%distributed_debug opens a post-mortem on a session's ranks, which keep the frames of their last error until "
    "the next cell; {why}. Run the cell in a session (`%%distributed --session`, or @distributed(session=...)) and "
    "call %distributed_debug after it raised, or put breakpoint() in the code to stop there while it runs."
)


class DebugServer:
    """Answers the debugger prompts of one call's ranks through `ask` (input) and shows their output with `show`."""

    def __init__(
        self,
        run_dir: Path,
        world_size: int,
        ask: Callable[[str], str] | None = None,
        show: Callable[[str], None] | None = None,
    ) -> None:
        self.run_dir = RunDir(run_dir)
        self.world_size = world_size
        self.ask = ask or (lambda prompt: builtins.input(prompt))
        self.show = show or (lambda text: print(text, end="", flush=True))
        #: The rank last answered with a command that brings it back to its prompt, and until when it keeps the turn.
        self.focus: tuple[int, float] | None = None
        #: The frontend cannot answer input requests: every prompt is answered `c`.
        self.no_stdin = False
        self.used = False

    def serve(self, only: int | None = None) -> float:
        """Answer every prompt waiting now (only rank `only`'s, if given); the seconds spent at prompts.

        In a foreground call the runner calls this from the notebook's main thread; elsewhere it does nothing.
        """
        if only is None and threading.current_thread() is not threading.main_thread():
            return 0.0
        spent = 0.0
        while True:
            prompts = debug_channel.waiting(self.run_dir.path, self.world_size)
            if only is not None:
                prompts = {r: p for r, p in prompts.items() if r == only}
            rank = self.pick(prompts)
            if rank is None:
                return spent
            started = time.monotonic()
            self.answer(prompts[rank])
            spent += time.monotonic() - started

    def pick(self, prompts: dict[int, Prompt]) -> int | None:
        if self.focus is not None:
            rank, until = self.focus
            if rank in prompts:
                return rank
            if time.monotonic() < until:
                return None  # the rank being stepped comes back to its prompt soon
            self.focus = None
        return min(prompts) if prompts else None

    def answer(self, prompt: Prompt) -> str:
        """Show one rank's output, ask for its command, hand it over; the command."""
        self.used = True
        if prompt.output:
            self.show(prompt.output if prompt.output.endswith("\n") else prompt.output + "\n")
        line = "c" if self.no_stdin else self._ask(prompt)
        delivered = debug_channel.answer(self.run_dir, prompt.rank, line)
        command = line.strip().split(";;")[0].split(" ")[0] if line.strip() else ""
        ends = command in {"c", "cont", "continue", "q", "quit", "exit", "EOF"}
        self.focus = None if ends or not delivered else (prompt.rank, time.monotonic() + FOCUS)
        if not delivered:
            self.show(f"air_magic: rank {prompt.rank} no longer waits for an answer (it ended).\n")
        return line

    def _ask(self, prompt: Prompt) -> str:
        try:
            return self.ask(prompt.prompt)
        except EOFError:
            return "EOF"
        except (NotImplementedError, OSError):  # IPython's StdinNotImplementedError; a captured or closed stdin
            self.no_stdin = True
            self.show(NO_STDIN.format(rank=prompt.rank, where=prompt.where or "?") + "\n")
            return "c"

    def close(self) -> None:
        """The call ended: remove its debugger files (its ranks are gone)."""
        if self.used or any(self.run_dir.path.glob("debug-*")):
            debug_channel.clean(self.run_dir.path, self.world_size)


def _world_size(run_dir: Path) -> int:
    return len(list(run_dir.glob("rank-*.log")))


def find_waiting(table: CallTable, ident: str | None = None) -> Path:
    """The run directory of the call `ident` names (a run directory's path, a call of this process's table: its
    number, its id or a unique start of it, or the id of any call of this user on the machine), or, without
    `ident`, the latest call of this process (`table`) with a rank waiting at a debugger prompt now."""
    if ident:
        path = Path(ident).expanduser()
        if path.is_dir():
            return path
        try:
            return table.find(ident).run_dir
        except AirMagicError as exc:
            from . import record as call_record

            try:  # the id of a call of another process on the machine: a detached call, the command line's
                if not ident.isdigit():
                    return call_record.find_dir(ident)
            except AirMagicError:
                pass
            raise ConfigurationError(str(exc)) from None
    for call in reversed(table.running()):
        if not call.has_run_dir(timeout=0):
            continue
        prompts = debug_channel.waiting(call.run_dir, call.world_size)
        if any(debug_channel.alive(p) for p in prompts.values()):
            return call.run_dir
    raise ConfigurationError("no rank of any call waits at a breakpoint now.")


def attach(run_dir: Path, rank: int | None = None, ask: Callable[[str], str] | None = None) -> None:
    """Serve the debugger of `rank` (default: the lowest waiting) of the call in `run_dir` from this cell, until
    it continues (`c`), quits (`q`) or ends."""
    run_dir = Path(run_dir)
    size = _world_size(run_dir)
    prompts = {r: p for r, p in debug_channel.waiting(run_dir, size).items() if debug_channel.alive(p)}
    if rank is None and prompts:
        rank = min(prompts)
    if rank is None or rank not in prompts:
        which = ", ".join(map(str, sorted(prompts))) or "none"
        raise ConfigurationError(
            f"rank {rank} of {run_dir.name} does not wait at a breakpoint now (ranks waiting: {which})."
        )
    server = DebugServer(run_dir, size, ask=ask)
    server.answer(prompts[rank])
    while server.focus is not None:  # stepping: wait for its next prompt, as long as the rank lives
        prompt = debug_channel.read_prompt(server.run_dir, rank)
        if prompt is None:
            if not _rank_running(server.run_dir, rank, prompts[rank]):
                return
            time.sleep(_POLL)
            continue
        server.answer(prompt)


def _rank_running(run_dir: RunDir, rank: int, last: Prompt) -> bool:
    done = run_dir.result(rank).exists() or run_dir.error(rank).exists()
    return not done and debug_channel.alive(last)
