"""`air-magic list`, `get` and `logs`: what a run is and what its nodes (or ranks) wrote, in text or as the
runtime's JSON.

`list [--limit N] [--all-status] [--filter k=v]` lists active runs (every run with `--all-status`), newest
first; filter keys `experiment` (a glob), `accelerator_type` (a substring), `num_accelerators`, `status` and
`user`. `get ID` says a run's state, attempt, MLflow run, alerts and each rank's value or error. `logs ID
[--node N] [--rank R] [--retry A] [--lines N] [--follow] [--download-to DIR]` prints one node's log of one
attempt (the latest by default). Not for: controlling runs (cli/control.py).
"""

from __future__ import annotations

import argparse
import fnmatch
import getpass
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..calls import record as call_record
from ..launch.files.rundir import RunDir
from .control import follow_any
from .events import log_events
from .files import WorkloadDir
from .output import ACTIVE, envelope, exit_code, iso, run_fields, state
from .reading import UsageError, failures, find, ranks_of, when

#: Keys of `list --filter`.
FILTERS = ("experiment", "accelerator_type", "num_accelerators", "status", "user")


def _row(record: dict[str, Any]) -> dict[str, Any]:
    path = Path(record["run_dir"])
    info = WorkloadDir(path).read_info() or {}
    started, ended = record.get("started"), record.get("ended")
    return {
        "run_id": record["id"],
        "run_name": record.get("name"),
        "experiment_name": info.get("experiment_name"),
        "user": getpass.getuser(),
        "status": state(path, record),
        "started_at": iso(started),
        "duration_seconds": round((ended or time.time()) - started, 1) if started else None,
        "accelerators": f"{info.get('num_accelerators') or record.get('world_size')} x "
        f"{info.get('accelerator_type') or record.get('accelerator_type')}",
        "is_sweep": False,
        "origin": record.get("origin"),
    }


def _keeps(row: dict[str, Any], key: str, value: str) -> bool:
    """Row `row` passes the filter `key=value`."""
    if key == "experiment":
        return fnmatch.fnmatch(str(row.get("experiment_name") or row.get("run_name") or "").lower(), value.lower())
    if key == "accelerator_type":
        return value.lower() in row["accelerators"].lower()
    if key == "num_accelerators":
        return bool(row["accelerators"].split(" x ")[0] == value)
    if key == "status":
        return bool(row["status"] == value.upper())
    return bool(row["user"] == value)


def _matches(row: dict[str, Any], filters: list[str]) -> bool:
    for text in filters:
        key, sep, value = text.partition("=")
        if not sep or key not in FILTERS:
            raise UsageError(f"--filter {text!r} must be KEY=VALUE with KEY one of {', '.join(FILTERS)}")
        if not _keeps(row, key, value):
            return False
    return True


def cmd_list(args: argparse.Namespace) -> int:
    if args.limit <= 0:
        raise UsageError(f"--limit must be more than 0, got {args.limit}")
    rows = [_row(r) for r in reversed(call_record.all_records())]
    if not args.all_status:
        rows = [r for r in rows if r["status"] in ACTIVE]
    rows = [r for r in rows if _matches(r, args.filter)][: args.limit]
    if args.json:
        print(envelope({"runs": rows}))
        return 0
    if not rows:
        print("No active runs." if not args.all_status else "No runs on this machine yet.")
        return 0
    width = max(len(r["run_id"]) for r in rows)
    print(f"{'Run ID':<{width}}  {'Experiment':<24}  {'Status':<9}  {'Started':<19}  Duration  Accelerators")
    for r in rows:
        name = str(r["experiment_name"] or r["run_name"])[:24]
        duration = f"{r['duration_seconds']:.0f} s" if r["duration_seconds"] is not None else "-"
        started = r["started_at"][:19].replace("T", " ") if r["started_at"] else "-"
        print(
            f"{r['run_id']:<{width}}  {name:<24}  {r['status']:<9}  {started:<19}  {duration:>8}  {r['accelerators']}"
        )
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    from .mlflow_ui import get_line, lasting_link

    path = find(args.id)
    record = call_record.load(path) or {}
    while args.watch and record.get("status") in call_record.LIVE:
        time.sleep(0.5)
        record = call_record.load(path) or record
    code = exit_code(state(path, record)) if args.watch else 0
    files = WorkloadDir(path)
    info = files.read_info() or {}
    attempts = files.attempts()
    row = _row(record)
    data = {
        **row,
        "attempt_number": attempts[-1] if attempts else 0,
        "max_retries": info.get("max_retries"),
        "mlflow_url": lasting_link(record),
        "mlflow": {"run_id": record.get("run_id"), "tracking_uri": record.get("tracking_uri")},
        "alerts": files.read_alerts(),
        "profiles": record.get("profiles") or [],
        "workload": info,
        "ranks": ranks_of(path, record),
        **run_fields(path, record),
    }
    if args.json:
        print(envelope(data))
        return code
    for key in ("run_id", "run_name", "experiment_name", "status", "attempt_number", "max_retries", "accelerators"):
        print(f"{key}: {data.get(key)}")
    print(f"run_dir: {path}")
    print(
        f"started: {when(record.get('started'))}" + (f"  ended: {when(record['ended'])}" if record.get("ended") else "")
    )
    if record.get("waiting_for"):
        print(f"waiting for: {record['waiting_for']}")
    print(get_line(record))
    for alert in data["alerts"]:
        print(f"ALERT {alert['kind']} (attempt {alert['attempt']}, node {alert['node']}): {alert['line']}")
    for profile in data["profiles"]:
        print(f"profile: {profile['summary']}; merged trace: {profile['trace']}")
    label = "node" if info.get("kind") == "command" else "rank"
    for rank in data["ranks"]:
        unit = files.unit_of(rank["rank"])
        what = rank.get("value") or rank.get("error") or rank.get("value_error") or ""
        if unit is not None:
            print(f"{label} {unit}: {rank['state']} {what}".rstrip())
    if record.get("status") == call_record.FAILED:
        print("\n".join(["error:", *(f"  {line}" for line in failures(path, record))]))
    return code


def _log_of(path: Path, info: dict[str, Any], unit: int, retry: int) -> Path:
    """The log of node (or rank) `unit` for attempt `retry` (-1: the latest)."""
    files = WorkloadDir(path)
    attempts = files.attempts()
    if retry >= 0 and retry not in attempts:
        raise UsageError(f"--retry {retry}: run {path.name} has attempts {attempts or [0]}")
    if info.get("kind") == "command" and attempts:
        kept = files.node_log(attempts[-1] if retry < 0 else retry, unit)
        if kept.exists():  # a node of another machine keeps its attempts there: its log here is the whole one
            return kept
    return RunDir(path).log(unit * files.per_node)


def cmd_logs(args: argparse.Namespace) -> int:
    if args.minutes is not None:
        raise UsageError("--minutes is not supported here: a node's log keeps no time per line; use --lines N")
    if args.lines is not None and args.lines < 0:
        raise UsageError(f"--lines must be 0 or more, got {args.lines}")
    path = find(args.id)
    record = call_record.load(path) or {}
    info = WorkloadDir(path).read_info() or {}
    command = info.get("kind") == "command"
    world = int(info.get("num_nodes") or 1) if command else int(record.get("world_size", 1))
    if args.rank is not None and command:
        raise UsageError("--rank is for function runs; a command run's logs are per node: --node N")
    if args.node is not None and not command and args.node != 0:
        raise UsageError("--node is for command runs; a function run's logs are per rank: --rank R")
    chosen = args.node if command else args.rank
    units = [chosen] if chosen is not None else ([0] if command else list(range(world)))
    if any(u < 0 or u >= world for u in units):
        raise UsageError(f"run {path.name} has {'nodes' if command else 'ranks'} 0 to {world - 1}")
    if args.download_to:
        target = Path(args.download_to).expanduser() / "logs"
        target.mkdir(parents=True, exist_ok=True)
        every = units if chosen is not None else list(range(world))
        names = [f"{'node' if command else 'rank'}_{u}.log" for u in every]
        files = [
            str(shutil.copy(_log_of(path, info, u, args.retry), target / n)) for u, n in zip(every, names, strict=True)
        ]
        print(envelope({"run_id": path.name, "files": files})) if args.json else print("\n".join(files))
        return 0
    if args.follow:
        return follow_any(path, args.json)
    for unit in units:
        lines = _log_of(path, info, unit, args.retry).read_text(errors="replace").splitlines()
        if args.lines is not None:
            lines = lines[-args.lines :] if args.lines > 0 else []
        if args.json:
            for item in log_events(unit, "\n".join(lines)):
                print(item)
        elif len(units) > 1:
            sys.stdout.write("".join(f"[rank {unit}] {line}\n" for line in lines))
        else:
            sys.stdout.write("".join(f"{line}\n" for line in lines))
        if not lines:
            print(f"No logs available for run {path.name}. Run is {state(path, record)}", file=sys.stderr)
    return 0
