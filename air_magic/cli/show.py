"""`air-magic list`, `get` and `logs`: what a run is and what its nodes (or ranks) wrote, in text or as the
runtime's JSON.

`list [--limit N] [--all-status] [--filter k=v]` lists active runs (every run with `--all-status`), newest
first; filter keys `experiment` (a glob), `accelerator_type` (a substring), `num_accelerators`, `status` and
`user`. `get ID` says a run's state, attempt, MLflow run, alerts and each rank's value or error. `logs ID
[--node N] [--rank R] [--retry A] [--lines N] [--minutes M] [--follow] [--download-to DIR]` prints one node's log
of one attempt (the latest by default), or with `--rank R` the log of the rank whose RANK is R (a function run's
rank, or one that the command's launcher started: cli/command_rank.py); `--minutes` reads the log's time index.
Not for: controlling runs (cli/control.py).
"""

from __future__ import annotations

import argparse
import fnmatch
import getpass
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..calls import record as call_record
from ..launch.files.rundir import RunDir
from ..resources import size_text
from .command_rank import lines_since, rank_file
from .command_watch import command_ranks
from .control import follow_any
from .events import log_events
from .files import WorkloadDir
from .output import ACTIVE, envelope, exit_code, iso, line, run_fields, state
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
        "command_ranks": command_ranks(files.command_ranks(attempts[-1])) if attempts else [],
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
    for rank in data["command_ranks"]:
        used = (
            "" if rank["memory"] is None else f": CPU {rank['cpu_percent']:.0f}% · memory {size_text(rank['memory'])}"
        )
        peak = "" if rank["peak_memory"] is None else f" · peak memory {size_text(rank['peak_memory'])}"
        peak += "".join(f" · GPU {index} {size_text(held)}" for index, held in rank.get("gpus", {}).items())
        now = "running" if rank["running"] else "ended"
        print(f"rank {rank['rank']} (node {rank['node']}, pid {rank['pid']}, {now}){used}{peak}")
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


def _rank_log(path: Path, rank: int, node: int | None, retry: int) -> Path:
    """The log of rank `rank` (its global RANK) that the command's launcher started, of attempt `retry` (-1: the
    latest); with `node`, the rank must have run there."""
    files = WorkloadDir(path)
    attempts = files.attempts()
    if retry >= 0 and retry not in attempts:
        raise UsageError(f"--retry {retry}: run {path.name} has attempts {attempts or [0]}")
    attempt = retry if retry >= 0 else (attempts[-1] if attempts else 0)
    ranks = files.command_ranks(attempt)
    if not ranks:
        raise UsageError(
            f"run {path.name}'s command started no rank of its own in attempt {attempt} (no torchrun, "
            "accelerate launch or python -m torch.distributed.run under it): its output is the node's log, --node N"
        )
    if rank not in ranks:
        raise UsageError(f"--rank {rank}: attempt {attempt} of run {path.name} has ranks {list(ranks)}")
    if node is not None and ranks[rank].name != f"node_{node}":
        raise UsageError(f"--rank {rank} ran on {ranks[rank].name.replace('_', ' ')}, not node {node}")
    return rank_file(ranks[rank], rank, "log")


def _lines(log: Path, minutes: int | None, last: int | None) -> list[str]:
    """The lines of `log` to show: those of the last `minutes` minutes (from its time index), the `last` ones."""
    if minutes is None:
        lines = log.read_text(errors="replace").splitlines()
    else:
        found = lines_since(log, time.time() - 60 * minutes)
        if found is None:
            raise UsageError(
                "--minutes: this log keeps no times (a function run's rank, a node of another machine); use --lines N"
            )
        lines = found
    if last is not None:
        lines = lines[-last:] if last > 0 else []
    return lines


def cmd_logs(args: argparse.Namespace) -> int:
    if args.minutes is not None and args.minutes <= 0:
        raise UsageError(f"--minutes must be more than 0, got {args.minutes}")
    if args.lines is not None and args.lines < 0:
        raise UsageError(f"--lines must be 0 or more, got {args.lines}")
    path = find(args.id)
    record = call_record.load(path) or {}
    info = WorkloadDir(path).read_info() or {}
    command = info.get("kind") == "command"
    world = int(info.get("num_nodes") or 1) if command else int(record.get("world_size", 1))
    if args.node is not None and not command and args.node != 0:
        raise UsageError("--node is for command runs; a function run's logs are per rank: --rank R")
    if command and args.rank is not None:
        if args.node is not None and not 0 <= args.node < world:
            raise UsageError(f"run {path.name} has nodes 0 to {world - 1}")
        logs = {args.rank: _rank_log(path, args.rank, args.node, args.retry)}
        label = "rank"
    else:
        chosen = args.node if command else args.rank
        units = [chosen] if chosen is not None else ([0] if command else list(range(world)))
        if any(u < 0 or u >= world for u in units):
            raise UsageError(f"run {path.name} has {'nodes' if command else 'ranks'} 0 to {world - 1}")
        if args.download_to and chosen is None:
            units = list(range(world))
        logs = {u: _log_of(path, info, u, args.retry) for u in units}
        label = "node" if command else "rank"
    if args.download_to:
        target = Path(args.download_to).expanduser() / "logs"
        target.mkdir(parents=True, exist_ok=True)
        files = [str(shutil.copy(log, target / f"{label}_{u}.log")) for u, log in logs.items()]
        print(envelope({"run_id": path.name, "files": files})) if args.json else print("\n".join(files))
        return 0
    if args.follow:
        return follow_any(path, args.json)
    for unit, log in logs.items():
        lines = _lines(log, args.minutes, args.lines)
        if args.json:
            node = int(log.parent.name.removeprefix("node_")) if command and label == "rank" else unit
            for item in log_events(node, "\n".join(lines)):
                print(line(json.loads(item) | {"rank": unit}) if command and label == "rank" else item)
        elif len(logs) > 1:
            sys.stdout.write("".join(f"[rank {unit}] {text}\n" for text in lines))
        else:
            sys.stdout.write("".join(f"{text}\n" for text in lines))
        if not lines:
            print(f"No logs available for run {path.name}. Run is {state(path, record)}", file=sys.stderr)
    return 0
