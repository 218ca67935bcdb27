"""NCCL's flight recorder: what a GPU rank records of its collectives, dumped into the run directory, read back.

torch keeps, per rank, a ring buffer of the last collectives each process
group ran (its sequence number, its name, whether it was scheduled, started
or completed) when TORCH_FR_BUFFER_SIZE (TORCH_NCCL_TRACE_BUFFER_SIZE before
torch 2.6) is set. `recorder_env` sets it for a GPU call, with where the
dumps go (TORCH_FR_DUMP_TEMP_FILE: `flight_recorder/rank_<N>` in the run
directory) and a named pipe per rank (TORCH_NCCL_DEBUG_INFO_PIPE_FILE:
`flight_recorder/pipe_<N>.pipe`) through which NCCL's own monitor thread
dumps on request, while the rank's Python is blocked. The watchdog dumps by
itself when a collective times out (TORCH_NCCL_DUMP_ON_TIMEOUT).

`ask_for_dumps` writes to each rank's pipe (the runner does, with the stacks);
`read_dumps` reads the dumps back (a restricted unpickler: plain data only),
and `collectives_summary`, a pure function, turns them into one sentence:
"rank 3 waits in all_reduce #1204; ranks 5 and 6 never reached it".

Not for: the stacks themselves (stacks.py), or deciding when to ask (calls/runner.py).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .rundir import RunDir

#: Entries the recorder keeps per rank: a ring buffer of the last collectives (a few hundred bytes each).
ENTRIES = 2000
#: The names of the dumps (`rank_<N>`) and pipes (`pipe_<N>.pipe`) in the run directory's flight_recorder/.
DUMP_PREFIX = "rank_"
PIPE_PREFIX = "pipe_"
_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_PIPE_VAR = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"


def _fr_names() -> bool:
    """torch names the recorder's settings TORCH_FR_* (and warns about the old names) from 2.8 on."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in re.findall(r"\d+", version("torch"))[:2])
    except (PackageNotFoundError, ValueError):
        return True
    return (major, minor) >= (2, 8)


def recorder_env(run_dir: Path, env: dict[str, str], pipes: bool = True) -> dict[str, str]:
    """What a GPU rank's environment adds so the recorder records, and dumps into the run directory.

    Only what `env` does not set already, under the names the installed torch reads. `pipes`: also a pipe per
    rank to ask for a dump (only where the run directory is on the ranks' machine: torch fails to make the process
    group if it cannot make the pipe).
    """
    out: dict[str, str] = {}
    new = _fr_names()
    if not any(k in env for k in _BUFFER_VARS):
        out[_BUFFER_VARS[0] if new else _BUFFER_VARS[1]] = str(ENTRIES)
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    where = RunDir(run_dir).flight_recorder
    try:
        where.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return out
    if not any(k in env for k in _FILE_VARS):
        out[_FILE_VARS[0] if new else _FILE_VARS[1]] = str(where / DUMP_PREFIX)
    if pipes and _PIPE_VAR not in env:
        out[_PIPE_VAR] = str(where / PIPE_PREFIX)
    return out


def _ranks_of(where: Path, prefix: str, suffix: str = "") -> dict[int, Path]:
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+){re.escape(suffix)}$")
    try:
        names = os.listdir(where)
    except OSError:
        return {}
    return {int(m[1]): where / name for name in names if (m := pattern.match(name))}


def ask_for_dumps(run_dir: Path) -> set[int]:
    """Ask each rank whose process group made a pipe to dump its recorder (its monitor thread reads the pipe
    about once a second); the ranks asked. Never blocks: a pipe no one reads is skipped."""
    asked: set[int] = set()
    for rank, pipe in _ranks_of(RunDir(run_dir).flight_recorder, PIPE_PREFIX, ".pipe").items():
        try:
            if not stat.S_ISFIFO(os.lstat(pipe).st_mode):
                continue
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue  # ENXIO: its rank is gone (no reader)
        try:
            os.write(fd, b"1\n")
            asked.add(rank)
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def dumps_since(run_dir: Path, since: float) -> dict[int, Path]:
    """The ranks' dump files written after `since` (time.time())."""
    found = {}
    for rank, path in _ranks_of(RunDir(run_dir).flight_recorder, DUMP_PREFIX).items():
        try:
            if path.stat().st_mtime >= since - 1:
                found[rank] = path
        except OSError:
            pass
    return found


class _PlainData(pickle.Unpickler):
    """A dump is dicts, lists, tuples, strings and numbers: anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight recorder dump does not hold {module}.{name}")


def read_dump(data: bytes) -> dict[str, Any] | None:
    """One rank's dump (torch's pickle, or its JSON form); None if it is neither."""
    try:
        dump = _PlainData(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - a half-written or foreign file is no dump
        import json

        try:
            dump = json.loads(data)
        except ValueError:
            return None
    return dump if isinstance(dump, dict) else None


def read_dumps(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's dump in the run directory, by rank."""
    out = {}
    for rank, path in _ranks_of(RunDir(run_dir).flight_recorder, DUMP_PREFIX).items():
        try:
            dump = read_dump(path.read_bytes())
        except OSError:
            continue
        if dump is not None:
            out[rank] = dump
    return out


def wait_for_dumps(run_dir: Path, ranks: Iterable[int], since: float, limit: float) -> dict[int, Path]:
    """Wait up to `limit` s for a fresh dump of each of `ranks`; the ones that came."""
    wanted = set(ranks)
    deadline = time.monotonic() + limit
    while True:
        found = dumps_since(run_dir, since)
        if wanted <= set(found) or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


# -- the one sentence ---------------------------------------------------------------------
def _name(entry: dict[str, Any]) -> str:
    """'nccl:all_reduce' -> 'all_reduce'."""
    return str(entry.get("profiling_name") or "a collective").split(":")[-1]


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _verb(ranks: list[int], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


class _Progress:
    """Where one rank is in one process group: the collectives it entered and completed, by sequence number."""

    def __init__(self, entries: list[dict[str, Any]], status: dict[str, Any] | None) -> None:
        self.by_seq = {int(e["collective_seq_id"]): e for e in entries if not e.get("is_p2p")}
        seqs = list(self.by_seq)
        done = [s for s, e in self.by_seq.items() if e.get("state") == "completed"]
        self.entered = max(seqs, default=0)
        self.completed = max(done, default=0)
        if status:  # torch's own count (gloo's entries stay "scheduled" after they complete)
            self.entered = max(self.entered, int(status.get("last_enqueued_collective", -1)))
            self.completed = max(self.completed, int(status.get("last_completed_collective", -1)))


def _groups(dumps: dict[int, dict[str, Any]]) -> list[tuple[str, str]]:
    """(pg name, description) of every process group in the dumps, the default group first."""
    seen: dict[str, str] = {}
    for dump in dumps.values():
        for entry in dump.get("entries") or []:
            pg = entry.get("process_group") or ("", "")
            seen.setdefault(str(pg[0]), str(pg[1]))
    return sorted(seen.items(), key=lambda g: (g[1] != "default_pg", g[0]))


def _expected(dumps: dict[int, dict[str, Any]], pg: str) -> set[int]:
    """The global ranks of group `pg`, as its config says; else the ranks that recorded it."""
    for dump in dumps.values():
        ranks = ((dump.get("pg_config") or {}).get(pg) or {}).get("ranks")
        if isinstance(ranks, str):
            try:
                return {int(r) for r in re.findall(r"\d+", ranks)}
            except ValueError:
                pass
    return {r for r, d in dumps.items() if any(str(e["process_group"][0]) == pg for e in d.get("entries") or [])}


def collectives_summary(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> str | None:
    """One sentence on where the collectives stand, from each rank's flight recorder dump (by global rank).

    'rank 3 waits in all_reduce #1204; ranks 5 and 6 never reached it (their last was #1203)'. The first process
    group (the default one first) where a rank waits is described; None if the dumps say nothing (no entries).
    """
    groups = _groups(dumps)
    if not groups:
        return None
    for pg, desc in groups:
        members = _expected(dumps, pg) | (set(range(world_size)) if world_size and desc == "default_pg" else set())
        members = members or set(dumps)
        progress = {
            rank: _Progress(
                [e for e in dump.get("entries") or [] if str((e.get("process_group") or ("",))[0]) == pg],
                (dump.get("pg_status") or {}).get(pg),
            )
            for rank, dump in dumps.items()
            if rank in members
        }
        waiting = {r: p.completed + 1 for r, p in progress.items() if p.entered > p.completed}
        if not waiting:
            continue
        seq = min(waiting.values())
        at_seq = sorted(r for r, s in waiting.items() if s == seq)
        entry = progress[at_seq[0]].by_seq.get(seq, {})
        name = _name(entry)
        inside = [r for r in at_seq if _name(progress[r].by_seq.get(seq, entry)) == name]
        group = "" if desc == "default_pg" or not desc else f" (group {desc})"
        parts = [f"{_ranks_text(inside)} {_verb(inside, 'waits', 'wait')} in {name} #{seq}{group}"]
        behind = sorted(r for r, p in progress.items() if p.entered < seq)
        if behind:
            lasts = sorted({progress[r].entered for r in behind})
            last = "their last was" if len(behind) > 1 else "its last was"
            last_text = ", ".join(f"#{s}" if s > 0 else "none" for s in lasts)
            parts.append(f"{_ranks_text(behind)} never reached it ({last} {last_text})")
        other = sorted(r for r, p in progress.items() if r not in inside and _name(p.by_seq.get(seq, entry)) != name)
        if other:
            parts.append(f"{_ranks_text(other)} entered {_name(progress[other[0]].by_seq[seq])} #{seq} instead")
        missing = sorted(members - set(dumps))
        if missing:
            parts.append(f"no record from {_ranks_text(missing)}")
        return "; ".join(parts)
    pg, desc = groups[0]
    lasts = [
        _Progress([e for e in d.get("entries") or [] if str(e["process_group"][0]) == pg], None).entered
        for d in dumps.values()
    ]
    return f"no rank waits in a collective (the last completed was #{max(lasts, default=0)})"


def recorder_note(run_dir: Path, world_size: int | None = None) -> str | None:
    """What the recorder's dumps say, and where they are; None if there are none."""
    where = RunDir(run_dir).flight_recorder
    dumps = read_dumps(run_dir)
    files = sorted(_ranks_of(where, DUMP_PREFIX))
    if not files:
        return None
    said = collectives_summary(dumps, world_size) if dumps else None
    head = f"NCCL's flight recorder: {said}. " if said else ""
    return (
        f"{head}Every rank's record ({', '.join(f'{DUMP_PREFIX}{r}' for r in files)}) is in {where}; read them "
        f"with: torchfrtrace {where} --prefix {DUMP_PREFIX} --allow-incomplete-ranks"
    )
