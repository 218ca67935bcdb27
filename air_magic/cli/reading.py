"""What the command line reads of a call and prints: its summary, each rank's state and value or error, how it
failed. The run directory's formats are calls/record.py's and launch/files/'s; this module only shapes them for
`get`, `list`, `--watch` and `--json`. Not for: controlling a call (cli/main.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..calls import record as call_record
from ..errors import AirMagicError

#: Fields of a call in `list --json`.
SUMMARY = (
    "id",
    "name",
    "status",
    "run_dir",
    "origin",
    "world_size",
    "accelerator_type",
    "num_nodes",
    "started",
    "ended",
    "owner",
    "run_id",
    "link",
    "error",
    "waiting_for",
)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def summary(record: dict[str, Any]) -> dict[str, Any]:
    return {key: record.get(key) for key in SUMMARY}


def ranks_of(path: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rank's state, exit code, and value (its repr) or error, as the run directory holds them."""
    from ..launch.files.rank_files import outcome
    from ..launch.files.rundir import RunDir

    run = RunDir(path)
    states, codes = record.get("states") or [], record.get("returncodes") or []
    ranks = []
    for rank in range(int(record.get("world_size", 0))):
        entry: dict[str, Any] = {
            "rank": rank,
            "state": states[rank] if rank < len(states) else record.get("status"),
            "returncode": codes[rank] if rank < len(codes) else None,
            "log": str(run.log(rank)),
        }
        if record.get("status") not in call_record.LIVE:
            found = outcome(run, rank)
            if found.error is not None:
                entry["error"] = f"{type(found.error).__name__}: {found.error}"
                entry["traceback"] = traceback_of(run.error(rank))
            elif found.value is not None:
                try:
                    import cloudpickle

                    entry["value"] = repr(cloudpickle.loads(found.value))
                except Exception as exc:  # noqa: BLE001 - a value whose class is not importable here
                    entry["value_error"] = f"cannot read the value here: {type(exc).__name__}: {exc}"
        ranks.append(entry)
    return ranks


def traceback_of(error_file: Path) -> str | None:
    """The rank's traceback, as its error record keeps it."""
    try:
        text = str(json.loads(error_file.read_text()).get("traceback") or "")
    except (OSError, ValueError, AttributeError):
        return None
    lines, ours = [], False
    for line in text.splitlines():  # the frames of the rank's own code: air_magic's worker frame left out
        if line.startswith("  File "):
            ours = f"{Path(__file__).parents[1]}{os.sep}" in line
        if not ours:
            lines.append(line)
    return "\n".join(lines) or None


def when(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else "-"


def failures(path: Path, record: dict[str, Any]) -> list[str]:
    """How an ended call failed, in lines: each failed rank's exception (with its traceback), or the call's error."""
    lines = []
    for rank in ranks_of(path, record):
        if rank.get("error"):
            lines.append(f"rank {rank['rank']} raised {rank['error']}")
            lines += [f"    {line}" for line in (rank.get("traceback") or "").rstrip().splitlines()]
    if not lines and record.get("error"):
        lines.append(str(record["error"]))
    return lines


class UsageError(AirMagicError):
    """A call that does not exist, a bad option: exit code 2."""


class NotFound(UsageError):
    """No call has that id (or a unique start of it): exit code 2, error code NOT_FOUND."""


def find(call_id: str) -> Path:
    """The run directory of the call `call_id` names (its id or a unique start of it); else a one-line UsageError."""
    try:
        return call_record.find_dir(call_id)
    except AirMagicError as exc:
        raise NotFound(str(exc)) from None
