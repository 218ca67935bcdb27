"""`air-magic`: the command line, a thin skin over the same owner of calls as the notebook.

`run -f job.yaml` checks the workload file (cli/jobfile.py), builds the JobSpec both notebook doors build,
and starts it as a detached call (detached.py): it prints the call's id and returns, or with `--watch`
follows it (cli/watch.py) and exits with the call's code. `list`, `get`, `logs`, `cancel`, `stop` and
`attach` read and control every call of this user on the machine, the command line's and every kernel's,
through their run directories (call_record.py). Each takes `--json` for scripts. Exit codes: 0 finished
(or done), 1 failed, 130 cancelled, 2 a bad command line or workload file (nothing started).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from .. import call_record
from ..errors import AirMagicError

#: The exit code of a call by its status.
EXIT = {call_record.FINISHED: 0, call_record.FAILED: 1, call_record.CANCELLED: 130}
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


class UsageError(AirMagicError):
    """A call that does not exist, a bad option: exit code 2."""


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def summary(record: dict[str, Any]) -> dict[str, Any]:
    return {key: record.get(key) for key in SUMMARY}


def _find(call_id: str) -> Path:
    try:
        return call_record.find_dir(call_id)
    except AirMagicError as exc:
        raise UsageError(str(exc)) from None


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
            elif found.value is not None:
                try:
                    import cloudpickle

                    entry["value"] = repr(cloudpickle.loads(found.value))
                except Exception as exc:  # noqa: BLE001 - a value whose class is not importable here
                    entry["value_error"] = f"cannot read the value here: {type(exc).__name__}: {exc}"
        ranks.append(entry)
    return ranks


# -- commands ---------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from .. import detached, leases
    from .jobfile import load

    job = load(args.file, args.override)
    if args.dry_run:
        described = job.describe()
        _print_json(described) if args.json else print("\n".join(f"{k}: {v}" for k, v in described.items()))
        return 0
    spec = job.spec()
    leases.set_role("cli")
    path = detached.start(spec, role="cli", experiment_name=job.experiment_name, cwd=str(job.root))
    record = call_record.load(path) or {}
    if args.json and not args.watch:
        _print_json(summary(record))
        return 0
    if not args.watch:
        print(path.name)
        return 0
    if args.json:
        print(json.dumps(summary(record)), file=sys.stderr)
    else:
        print(f"air-magic: {path.name} started; its run directory is {path}", flush=True)
    return _follow(path, args.json)


def _follow(path: Path, as_json: bool) -> int:
    from .watch import follow

    final = follow(path, out=sys.stderr if as_json else sys.stdout)
    if as_json:
        _print_json({**summary(final), "ranks": ranks_of(path, final)})
    return EXIT.get(str(final.get("status")), 1)


def cmd_list(args: argparse.Namespace) -> int:
    records = call_record.all_records()
    if args.json:
        _print_json([summary(r) for r in records])
        return 0
    from ..attached import machine_table

    print(machine_table())
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    path = _find(args.id)
    record = call_record.load(path) or {}
    out = {
        **summary(record),
        "mlflow": {"run_id": record.get("run_id"), "link": record.get("link")},
        "ranks": ranks_of(path, record),
    }
    if args.json:
        _print_json(out)
        return 0
    for key in ("id", "name", "status", "run_dir", "started", "ended", "error"):
        if out.get(key) is not None:
            print(f"{key}: {out[key]}")
    print(f"mlflow: {record.get('run_id') or '-'} {record.get('link') or ''}".rstrip())
    for rank in out["ranks"]:
        what = rank.get("value") or rank.get("error") or rank.get("value_error") or ""
        print(f"rank {rank['rank']}: {rank['state']} {what}".rstrip())
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from ..launch.files.rundir import RunDir

    path = _find(args.id)
    record = call_record.load(path) or {}
    world = int(record.get("world_size", 1))
    ranks = [args.rank] if args.rank is not None else list(range(world))
    if any(r < 0 or r >= world for r in ranks):
        raise UsageError(f"--rank {args.rank}: call {path.name} has ranks 0 to {world - 1}")
    if args.download_to:
        target = Path(args.download_to).expanduser()
        target.mkdir(parents=True, exist_ok=True)
        files = [str(shutil.copy(RunDir(path).log(r), target / RunDir(path).log(r).name)) for r in ranks]
        _print_json({"id": path.name, "files": files}) if args.json else print("\n".join(files))
        return 0
    if args.follow:
        return _follow(path, args.json)
    texts = {r: RunDir(path).log(r).read_text(errors="replace") for r in ranks}
    if args.json:
        _print_json({"id": path.name, "status": record.get("status"), "logs": {str(r): t for r, t in texts.items()}})
        return 0
    for rank, text in texts.items():
        if args.rank is not None:
            sys.stdout.write(text)
        else:
            sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if not args.ids and not args.all:
        raise UsageError("cancel needs call ids, or --all for every running call")
    if args.all:
        paths = [Path(r["run_dir"]) for r in call_record.all_records() if r.get("status") in call_record.LIVE]
    else:
        paths = [_find(i) for i in args.ids]
    done = []
    for path in paths:
        live = (call_record.load(path) or {}).get("status") in call_record.LIVE
        asked = live and call_record.request_cancel(path)
        done.append({"id": path.name, "cancel_requested": bool(live), "already_requested": live and not asked})
    if args.json:
        _print_json(done)
    else:
        for entry in done:
            print(f"{entry['id']}: {'cancel requested' if entry['cancel_requested'] else 'not running'}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from ..stopping import request_stop

    path = _find(args.id)
    live = (call_record.load(path) or {}).get("status") in call_record.LIVE
    asked = live and request_stop(path)
    if args.json:
        _print_json({"id": path.name, "stop_requested": bool(live), "already_requested": live and not asked})
    else:
        print(f"{path.name}: {'stop requested (should_stop() is True on every rank)' if live else 'not running'}")
    return 0


def cmd_attach(args: argparse.Namespace) -> int:
    path = _find(args.id)
    return _follow(path, args.json)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="air-magic",
        description="Run a workload file on every rank of this node (or of a Ray cluster), and see or control "
        "every air_magic call of this user on this machine.",
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help, description=help)
        cmd.add_argument("--json", action="store_true", help="Print JSON, for scripts.")
        return cmd

    run = add("run", "Run a workload file; prints the call's id and returns (or follows it with --watch).")
    run.add_argument("-f", "--file", required=True, help="The workload file (YAML).")
    run.add_argument("--watch", action="store_true", help="Follow every rank's output; exit with the call's code.")
    run.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Change a field: compute.num_accelerators=2",
    )
    run.add_argument("--dry-run", action="store_true", help="Check the file and say what would run; start nothing.")
    run.set_defaults(func=cmd_run)
    add("list", "Every call of this user on this machine: id, name, status, owner.").set_defaults(func=cmd_list)
    get = add("get", "One call: status, MLflow run, each rank's value or error.")
    get.add_argument("id", help="The call's id (a unique prefix is enough).")
    get.set_defaults(func=cmd_get)
    logs = add("logs", "What the ranks of a call wrote.")
    logs.add_argument("id", help="The call's id (a unique prefix is enough).")
    logs.add_argument("--rank", type=int, default=None, metavar="R", help="Only rank R.")
    logs.add_argument("--follow", action="store_true", help="Follow until the call ends.")
    logs.add_argument("--download-to", default=None, metavar="DIR", help="Copy the logs into DIR.")
    logs.set_defaults(func=cmd_logs)
    cancel = add("cancel", "Stop every rank of calls now.")
    cancel.add_argument("ids", nargs="*", metavar="ID", help="Calls to cancel.")
    cancel.add_argument("--all", action="store_true", help="Every running or waiting call of this user.")
    cancel.set_defaults(func=cmd_cancel)
    stop = add("stop", "Ask a call's ranks to stop after their current step (air_magic.should_stop()).")
    stop.add_argument("id", help="The call's id (a unique prefix is enough).")
    stop.set_defaults(func=cmd_stop)
    attach = add("attach", "Follow a call's output live from its first line; exit with its code.")
    attach.add_argument("id", help="The call's id (a unique prefix is enough).")
    attach.set_defaults(func=cmd_attach)
    return top


def main(argv: list[str] | None = None) -> int:
    """The `air-magic` console script."""
    from ..errors import ConfigurationError
    from .jobfile import JobFileError

    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (JobFileError, UsageError, ConfigurationError) as exc:
        print(f"air-magic: error: {exc}", file=sys.stderr)
        return 2
    except AirMagicError as exc:
        print(f"air-magic: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `air-magic list | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
