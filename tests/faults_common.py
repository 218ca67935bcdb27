"""Checks shared by the fault and security tests: nothing left running, nothing printed lost, runs driven in-process."""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
from helpers import leftover_processes

from air_magic import distributed
from air_magic.job import JobResult, RankState
from air_magic.launch.files.rundir import RunDir
from air_magic.listeners import Listener, RunContext
from air_magic.owner import owner

_LOGS_IN = re.compile(r"air_magic: .* logs in (\S+)")


def run_dirs(stdout: str) -> list[Path]:
    """The run directories the text display announced, in order."""
    return [Path(m) for m in _LOGS_IN.findall(stdout)]


def assert_nothing_left(before: set[int]) -> None:
    """No worker, nor anything a worker started, outlives the call (psutil)."""
    left = leftover_processes(before, wait=5, kind="job")
    assert left == [], [(p.pid, p.cmdline()[:4]) for p in left]


def assert_nothing_lost(run_dir: Path, printed: dict[int, list[str]], shown: str | None = None) -> int:
    """Every line each rank printed is in its log file (and in the display's output when given); returns lines
    checked."""
    checked = 0
    for rank, lines in printed.items():
        log = RunDir(run_dir).log(rank).read_bytes().decode("utf-8", errors="replace")
        missing = [line for line in lines if line not in log]
        if missing:  # what the run directory held then, for whoever reads the failure
            held = sorted((p.name, p.stat().st_size) for p in Path(run_dir).iterdir() if p.is_file())
            raise AssertionError(
                f"rank {rank}'s log {run_dir} lacks {missing[:3]}; it holds {len(log)} characters, starting "
                f"{log[:200]!r}; the run directory holds {held}"
            )
        if shown is not None:
            absent = [line for line in lines if f"[rank {rank}] {line}" not in shown]
            assert not absent, f"the display did not show rank {rank}'s {absent[:3]}"
        checked += len(lines)
    return checked


def fault_time(run_dir: Path, rank: int) -> float:
    """The wall-clock time a rank printed as `FAULT_AT <t>` just before its fault."""
    text = RunDir(run_dir).log(rank).read_text(errors="replace")
    return float(re.findall(r"FAULT_AT ([0-9.]+)", text)[-1])


def pids_in(run_dir: Path, rank: int) -> list[int]:
    """Process ids a rank printed as `PIDS a b c`."""
    text = RunDir(run_dir).log(rank).read_text(errors="replace")
    return [int(p) for line in re.findall(r"PIDS ([0-9 ]+)", text) for p in line.split()]


def alive(pids: list[int]) -> list[int]:
    """The ids of `pids` that are still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


class Recorder(Listener):
    """Keeps what the runner reported: output per rank, states, the context; may cancel on a trigger."""

    def __init__(self, cancel_when: str | None = None) -> None:
        self.text: dict[int, list[str]] = {}
        self.chars: dict[int, int] = {}
        self.states: dict[int, list[RankState]] = {}
        self.cancel_when = cancel_when
        self.tails: dict[int, str] = {}
        self.cancelled_at: float | None = None
        self.result: JobResult | None = None

    def on_start(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def on_output(self, rank: int, text: str) -> None:
        self.chars[rank] = self.chars.get(rank, 0) + len(text)
        if sum(len(t) for t in self.text.get(rank, [])) < 1 << 20:  # keep the head only: floods are counted
            self.text.setdefault(rank, []).append(text)
        if self.cancel_when and self.cancelled_at is None:
            # Output arrives in pieces cut anywhere: look for the trigger across the end of the last piece too.
            seen = self.tails.get(rank, "") + text
            self.tails[rank] = seen[-len(self.cancel_when) :]
            if self.cancel_when in seen:
                self.cancelled_at = time.time()
                self.ctx.cancel()

    def on_rank_state(self, rank: int, state: RankState) -> None:
        self.states.setdefault(rank, []).append(state)

    def on_end(self, result: JobResult) -> None:
        self.result = result

    def output(self, rank: int) -> str:
        return "".join(self.text.get(rank, []))


def run_here(func: Callable[..., Any], *args: Any, listener: Listener | None = None, **settings: Any) -> JobResult:
    """Run `func` through the one runner from this (test) process, with `listener` as the only listener."""
    module = inspect.getmodule(func)
    if module is not None and module.__name__ != "__main__":
        cloudpickle.register_pickle_by_value(module)  # workers need not import the test modules
    settings.setdefault("mlflow", False)
    settings.setdefault("num_accelerators", 2)
    wrapped = distributed(**settings)(func)
    spec = wrapped.settings.spec(func, args, {}, func.__name__)
    return owner().submit(spec, listeners=[listener or Recorder()]).raise_for_status()


#: Cell code for the kernel tests of faults: `timed(f)` calls f on the ranks and keeps its value or error and the
#: time it came back; `report(error, ended)` prints them as one REPORT line (read by helpers.reported).
FAULT_SETUP = """
import os, sys, time, json, threading
from air_magic import distributed
from air_magic.owner import owner

def timed(fn, *args, **kwargs):
    try:
        value, error = fn.distributed(*args, **kwargs), None
    except BaseException as exc:
        value, error = None, exc
    return value, error, time.time()

def report(error, ended):
    print("REPORT " + json.dumps({"type": type(error).__name__, "message": str(error),
          "notes": getattr(error, "__notes__", []), "ended": ended}))
"""


def procs() -> set[int]:
    """The pids of every process now, for a later leftover check."""
    return {p.pid for p in psutil.process_iter()}


def steps(rank: int, n: int = 3) -> list[str]:
    """The lines the fault scenarios' ranks print before their fault."""
    return [f"rank {rank} step {i}" for i in range(n)]
