"""`air-magic stacks ID`: where each rank of a command run is now, as every thread's Python stack.

The ranks are those the command's launcher started in the run's latest attempt (cli/command_rank.py): each
`rank_<R>.json` names its pid and create time; a rank still alive under that pid (the same process: its create time
matches) that catches `STACKS_SIGNAL` is sent it, and writes its stacks (faulthandler) into `rank_<R>.stacks`. What
it wrote is printed once it stops growing, waiting up to `--wait` seconds. Two askers of one rank take turns (a
lock on its stacks file). Exit 0 when every rank alive answered, else 1. Not for: a function run's ranks (the
notebook's Stacks button, launch/stacks.py).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from ..calls import record as call_record
from .command_rank import STACKS_SIGNAL, rank_file
from .command_watch import alive, here
from .files import WorkloadDir
from .output import envelope, state
from .reading import UsageError, find

#: A rank's dump is complete when its stacks file has not grown for this long, in seconds.
SETTLED = 0.2


def _catches(pid: int) -> bool:
    from ..launch.stacks import catches

    return catches(pid, STACKS_SIGNAL)


def _ranks(path: Path, only: int | None) -> tuple[int, list[dict[str, Any]]]:
    """The latest attempt, and its ranks' records (with `dir`), by rank."""
    files = WorkloadDir(path)
    attempts = files.attempts()
    attempt = attempts[-1] if attempts else 0
    found = []
    for rank, directory in files.command_ranks(attempt).items():
        if only is not None and rank != only:
            continue
        try:
            info = json.loads(rank_file(directory, rank, "json").read_text())
        except (OSError, ValueError):
            info = {"rank": rank, "pid": None}
        found.append({**info, "rank": rank, "dir": directory})
    return attempt, found


def _ask(ranks: list[dict[str, Any]], wait: float) -> None:
    """Signal each live rank and read its dump into its `stacks` (or say why not in `state`)."""
    asked: dict[int, tuple[int, int]] = {}  # rank -> (fd of its stacks file, its size before)
    deadline = time.monotonic() + wait
    try:
        for rank in ranks:
            if not here(rank):
                rank["state"] = f"on another machine ({rank['host']}): its stacks are asked by the watch when it hangs"
                continue
            if not rank.get("pid") or not alive(rank):
                rank["state"] = "ended"
                continue
            if not _catches(int(rank["pid"])):
                rank["state"] = "not ready"  # between its start and its hook: the signal's default would end it
                continue
            fd = os.open(rank_file(rank["dir"], rank["rank"], "stacks"), os.O_RDONLY | os.O_CREAT, 0o600)
            while True:  # another `stacks` asking the same rank: after its dump
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
            asked[rank["rank"]] = (fd, os.fstat(fd).st_size)
            assert STACKS_SIGNAL is not None
            os.kill(int(rank["pid"]), STACKS_SIGNAL)
        sizes = {r: (size, time.monotonic()) for r, (_, size) in asked.items()}
        waiting = set(asked)
        while waiting and time.monotonic() < deadline:
            time.sleep(0.02)
            for r in list(waiting):
                size = os.fstat(asked[r][0]).st_size
                if size != sizes[r][0]:
                    sizes[r] = (size, time.monotonic())
                elif size > asked[r][1] and time.monotonic() - sizes[r][1] >= SETTLED:
                    waiting.discard(r)
        for rank in ranks:
            if rank["rank"] in asked:
                fd, before = asked[rank["rank"]]
                text = os.pread(fd, os.fstat(fd).st_size - before, before).decode(errors="replace")
                rank["stacks"] = text.rstrip("\n")
                rank["state"] = "answered" if text else "no answer"
    finally:
        for fd, _ in asked.values():
            os.close(fd)


def cmd_stacks(args: argparse.Namespace) -> int:
    if args.wait <= 0:
        raise UsageError(f"--wait must be more than 0, got {args.wait}")
    path = find(args.id)
    record = call_record.load(path) or {}
    if (WorkloadDir(path).read_info() or {}).get("kind") != "command":
        raise UsageError(f"run {path.name} is not a command run; a function run's stacks are the notebook's Stacks")
    if STACKS_SIGNAL is None:
        raise UsageError("this platform has no real-time signals to ask a rank for its stacks")
    live = record.get("status") in call_record.LIVE
    attempt, ranks = _ranks(path, args.rank)
    if args.rank is not None and not ranks:
        raise UsageError(f"--rank {args.rank}: attempt {attempt} of run {path.name} has no such rank")
    if live:
        _ask(ranks, args.wait)
    for rank in ranks:
        rank.setdefault("state", "ended")
    answered = [r for r in ranks if r["state"] == "answered"]
    code = 0 if live and answered and all(r["state"] in ("answered", "ended") for r in ranks) else 1
    if args.json:
        keep = ("rank", "local_rank", "node", "pid", "state", "stacks")
        data = {"run_id": path.name, "status": state(path, record), "attempt": attempt}
        print(envelope({**data, "ranks": [{k: r.get(k) for k in keep} for r in ranks]}))
        return code
    if not live:
        print(f"{path.name}: not running ({state(path, record)}); no stacks to ask for")
        return 1
    if not ranks:
        print(
            f"{path.name}: its command started no rank of its own yet (torchrun, accelerate launch, python -m "
            "torch.distributed.run); a command without one runs as one process per node"
        )
        return 1
    for rank in ranks:
        where = f"rank {rank['rank']} (node {rank.get('node')}, local rank {rank.get('local_rank')}, pid {rank['pid']})"
        if rank["state"] == "answered":
            print(f"== {where}\n{rank['stacks']}\n")
        else:
            print(f"== {where}: {rank['state']}\n")
    return code
