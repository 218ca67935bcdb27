"""Debugger prompts of a run's ranks, answered from the terminal that follows the run: `air-magic attach`, and
`run --watch` / `logs --follow` when standard input is a terminal.

A rank stopped at `breakpoint()` waits at a prompt in its run directory (a function run's ranks: the run directory;
a command run's ranks: their node's directory of rank files, cli/command_rank.py), written and answered through
launch/files/debug_channel.py. `RunPrompts.serve()`, called from the follow loop (cli/watch.py) on the main thread,
shows what the rank's debugger printed and asks the terminal for each command, one rank at a time, with the calls'
own server (calls/debugging.py `DebugServer`), so stepping a rank keeps its turn: after a command that brings the
rank back to its prompt (`p x`, `n`), nothing else is printed until that prompt comes. While it asks, the run's
output waits. Where standard input ends (closed, or a pipe that has no more lines) the rank is told `c` and nothing
more is asked. Not for: a kernel's debugging (`%distributed_debug`), the rank's side.
"""

from __future__ import annotations

import builtins
import sys
import time
from pathlib import Path
from typing import Any

from ..calls.debugging import DebugServer
from ..launch.files import debug_channel
from .files import WorkloadDir

#: Seconds between two looks for the next prompt of a rank being stepped.
STEP_LOOK = 0.05


class RunPrompts:
    """The prompts of the run in `path` (its latest attempt, for a command run); `serve()` answers those waiting."""

    def __init__(self, path: Path, world_size: int) -> None:
        self.files = WorkloadDir(path)
        self.world_size = world_size
        self.servers: dict[Path, DebugServer] = {}
        self.ended = False  # standard input has no more lines: every prompt is answered `c`

    def directories(self) -> dict[Path, int]:
        """Where the run's ranks post their prompts now, each with the number of ranks to look for."""
        info = self.files.read_info() or {}
        if info.get("kind") != "command":
            return {self.files.path: self.world_size}
        attempts = self.files.attempts()
        ranks = self.files.command_ranks(attempts[-1]) if attempts else {}
        size = max(self.world_size, max(ranks, default=-1) + 1)  # the command's launcher may start more ranks
        return {directory: size for directory in set(ranks.values())}

    def serve(self, pause: Any = None) -> bool:
        """Answer every prompt waiting now (`pause()` first, once, if any waits); whether one was waiting."""
        waited = False
        for directory, size in sorted(self.directories().items()):
            server = self.servers.get(directory)
            if server is None:
                server = self.servers[directory] = DebugServer(directory, size, ask=self._ask)
            server.world_size = size
            if not waited and debug_channel.waiting(directory, size):
                waited = True
                if pause is not None:
                    pause()
            server.serve()
            while server.focus is not None and time.monotonic() < server.focus[1]:
                time.sleep(
                    STEP_LOOK
                )  # a rank being stepped comes back to its prompt: nothing else is printed meanwhile
                server.serve()
        return waited

    def _ask(self, prompt: str) -> str:
        if self.ended:
            return "c"
        try:
            line = builtins.input(prompt)
            if not sys.stdin.isatty():
                print(line, flush=True)  # a terminal shows what was typed; a pipe's answers are shown here
            return line
        except EOFError:
            self.ended = True
            print("\nair-magic: standard input ended: the rank continues (c)", flush=True)
            return "c"
