"""`air-magic`: the command line, a thin skin over the same owner of calls as the notebook.

`run -f job.yaml` checks the workload file (cli/jobfile.py), builds the JobSpec both notebook doors build,
and starts it as a detached call (calls/detached.py): it prints the call's id and returns, or with `--watch`
follows it (cli/watch.py) and exits with the call's code. `list`, `get`, `logs`, `cancel`, `stop` and
`attach` read and control every call of this user on the machine, the command line's and every kernel's,
through their run directories (calls/record.py; cli/reading.py shapes what they print), and `ui` serves the
MLflow UI of a local store (cli/mlflow_ui.py). Each takes `--json` for scripts. Exit codes: 0 finished
(or done), 1 failed, 130 cancelled, 2 a bad command line, workload file or call id (nothing started).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..calls import record as call_record
from ..errors import AirMagicError
from .mlflow_ui import cmd_ui
from .reading import UsageError, failures, find, print_json, ranks_of, summary, when

#: The exit code of a call by its status.
EXIT = {call_record.FINISHED: 0, call_record.FAILED: 1, call_record.CANCELLED: 130}
#: Seconds `cancel` waits for the calls it cancels to end, before it says they are still stopping.
CANCEL_WAIT = 20.0


# -- commands ---------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from ..owner import DETACHED, owner
    from .jobfile import load

    job = load(args.file, args.override)
    if args.dry_run:
        described = job.describe()
        print_json(described) if args.json else print("\n".join(f"{k}: {v}" for k, v in described.items()))
        return 0
    spec = job.spec()
    path = owner("cli").submit(spec, DETACHED, role="cli", experiment_name=job.experiment_name, cwd=str(job.root))
    record = call_record.load(path) or {}
    if args.json and not args.watch:
        print_json(summary(record))
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
    from .mlflow_ui import on_server
    from .watch import follow

    def ending(final: dict[str, Any]) -> list[str]:
        lines = failures(path, final) if final.get("status") == call_record.FAILED else []
        if final.get("run_id") and not on_server(final):
            lines.append(f"air-magic: its MLflow UI ends with this command; `air-magic ui {path.name}` serves it again")
        return lines

    final = follow(path, out=sys.stderr if as_json else sys.stdout, ending=ending)
    if as_json:
        print_json({**summary(final), "ranks": ranks_of(path, final)})
    return EXIT.get(str(final.get("status")), 1)


def cmd_list(args: argparse.Namespace) -> int:
    records = call_record.all_records()
    if args.json:
        print_json([summary(r) for r in records])
        return 0
    from ..calls.attached import machine_table

    print(machine_table())
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    from .mlflow_ui import get_line, lasting_link

    path = find(args.id)
    record = call_record.load(path) or {}
    while args.watch and record.get("status") in call_record.LIVE:
        time.sleep(0.5)
        record = call_record.load(path) or record
    out = {
        **summary(record),
        "mlflow": {
            "run_id": record.get("run_id"),
            "link": lasting_link(record),
            "tracking_uri": record.get("tracking_uri"),
        },
        "ranks": ranks_of(path, record),
    }
    code = EXIT.get(str(record.get("status")), 1) if args.watch else 0
    if args.json:
        print_json(out)
        return code
    for key in ("id", "name", "status", "run_dir"):
        print(f"{key}: {out.get(key)}")
    print(f"started: {when(out.get('started'))}" + (f"  ended: {when(out['ended'])}" if out.get("ended") else ""))
    if record.get("waiting_for"):
        print(f"waiting for: {record['waiting_for']}")
    print(get_line(record))
    for rank in out["ranks"]:
        what = rank.get("value") or rank.get("error") or rank.get("value_error") or ""
        print(f"rank {rank['rank']}: {rank['state']} {what}".rstrip())
    if record.get("status") == call_record.FAILED:
        print("\n".join(["error:", *(f"  {line}" for line in failures(path, record))]))
    return code


def cmd_logs(args: argparse.Namespace) -> int:
    from ..launch.files.rundir import RunDir

    path = find(args.id)
    record = call_record.load(path) or {}
    world = int(record.get("world_size", 1))
    ranks = [args.rank] if args.rank is not None else list(range(world))
    if any(r < 0 or r >= world for r in ranks):
        raise UsageError(f"--rank {args.rank}: call {path.name} has ranks 0 to {world - 1}")
    if args.download_to:
        target = Path(args.download_to).expanduser()
        target.mkdir(parents=True, exist_ok=True)
        files = [str(shutil.copy(RunDir(path).log(r), target / RunDir(path).log(r).name)) for r in ranks]
        print_json({"id": path.name, "files": files}) if args.json else print("\n".join(files))
        return 0
    if args.follow:
        return _follow(path, args.json)
    texts = {r: RunDir(path).log(r).read_text(errors="replace") for r in ranks}
    if args.json:
        print_json({"id": path.name, "status": record.get("status"), "logs": {str(r): t for r, t in texts.items()}})
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
        paths = [find(i) for i in args.ids]
    done, records = [], {}
    for path in paths:
        records[path.name] = call_record.load(path) or {}
        live = records[path.name].get("status") in call_record.LIVE
        asked = live and call_record.request_cancel(path)
        done.append({"id": path.name, "cancel_requested": bool(live), "already_requested": live and not asked})
    if args.json:
        print_json(done)
        return 0
    if not done:
        print("air-magic: no call is waiting or running; nothing to cancel")
    ended = _wait_ended([p for p, e in zip(paths, done, strict=True) if e["cancel_requested"]], CANCEL_WAIT)
    for entry in done:
        record = records[str(entry["id"])]
        what = f"{entry['id']} ({record.get('name')}, {record.get('status')})"
        if not entry["cancel_requested"]:
            print(f"{what}: not running; nothing to cancel")
        else:
            print(f"{what}: " + ("cancelled" if entry["id"] in ended else "cancel requested; its ranks are stopping"))
    return 0


def _wait_ended(paths: list[Path], patience: float) -> set[str]:
    """The ids of `paths`'s calls that ended within `patience` seconds."""
    deadline = time.monotonic() + patience
    while True:
        ended = {p.name for p in paths if (call_record.load(p) or {}).get("status") not in call_record.LIVE}
        if len(ended) == len(paths) or time.monotonic() > deadline:
            return ended
        time.sleep(0.2)


def cmd_stop(args: argparse.Namespace) -> int:
    from ..stopping import request_stop

    path = find(args.id)
    live = (call_record.load(path) or {}).get("status") in call_record.LIVE
    asked = live and request_stop(path)
    if args.json:
        print_json({"id": path.name, "stop_requested": bool(live), "already_requested": live and not asked})
    else:
        print(f"{path.name}: {'stop requested (should_stop() is True on every rank)' if live else 'not running'}")
    return 0


def cmd_attach(args: argparse.Namespace) -> int:
    path = find(args.id)
    return _follow(path, args.json)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="air-magic",
        description="Run a workload file on every rank of this node (or of a Ray cluster), and see or control "
        "every air_magic call of this user on this machine: the command line's and every notebook's.",
        epilog="ID is a call's id (`air-magic list`), or a unique start of it. Exit codes: 0 finished (or done), "
        "1 failed, 130 cancelled, 2 a bad command line, workload file or ID (nothing started).",
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, more: str = "", json: bool = True) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help, description=f"{help} {more}".strip())
        if json:
            cmd.add_argument("--json", action="store_true", help="Print JSON, for scripts.")
        return cmd

    run = add(
        "run",
        "Run a workload file; prints the call's id and returns (or follows it with --watch).",
        "The file's fields: experiment_name, mlflow_run_name, compute (num_accelerators, accelerator_type, "
        "num_nodes), command, or function (module:name) with args and kwargs, code_source (root_path), "
        "environment (dependencies), max_retries, timeout.",
    )
    run.add_argument("-f", "--file", required=True, help="The workload file (YAML).")
    run.add_argument("--watch", action="store_true", help="Follow every rank's output; exit with the call's code.")
    run.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Change a field, as often as needed: compute.num_accelerators=2",
    )
    run.add_argument("--dry-run", action="store_true", help="Check the file and say what would run; start nothing.")
    run.set_defaults(func=cmd_run)
    add("list", "Every call of this user on this machine: id, name, status, owner.").set_defaults(func=cmd_list)
    get = add("get", "One call: status, MLflow run, each rank's value or error.")
    get.add_argument("id", metavar="ID", help="The call's id (a unique prefix is enough).")
    get.add_argument("--watch", action="store_true", help="Wait for the call's end; exit with its code.")
    get.set_defaults(func=cmd_get)
    logs = add("logs", "What the ranks of a call wrote, each line prefixed by its rank.")
    logs.add_argument("id", metavar="ID", help="The call's id (a unique prefix is enough).")
    logs.add_argument("--rank", type=int, default=None, metavar="R", help="Only rank R.")
    logs.add_argument("--follow", action="store_true", help="Follow until the call ends; exit with its code.")
    logs.add_argument("--download-to", default=None, metavar="DIR", help="Copy the logs into DIR.")
    logs.set_defaults(func=cmd_logs)
    cancel = add("cancel", "Stop every rank of calls now; says which calls it cancelled.")
    cancel.add_argument("ids", nargs="*", metavar="ID", help="Calls to cancel.")
    cancel.add_argument("--all", action="store_true", help="Every running or waiting call of this user.")
    cancel.set_defaults(func=cmd_cancel)
    stop = add("stop", "Ask a call's ranks to stop after their current step (air_magic.should_stop()).")
    stop.add_argument("id", metavar="ID", help="The call's id (a unique prefix is enough).")
    stop.set_defaults(func=cmd_stop)
    attach = add("attach", "Follow a call's output live from its first line; exit with its code.")
    attach.add_argument("id", metavar="ID", help="The call's id (a unique prefix is enough).")
    attach.set_defaults(func=cmd_attach)
    ui = add(
        "ui",
        "Serve the MLflow UI of this machine's local store on 127.0.0.1 until Ctrl-C.",
        "With ID, the store of that call's run, and the link that opens it. A store that is a server needs none: "
        "its link is printed.",
        json=False,
    )
    ui.add_argument(
        "id", nargs="?", default=None, metavar="ID", help="A call whose MLflow run to open (a unique prefix is enough)."
    )
    ui.set_defaults(func=cmd_ui)
    return top


def main(argv: list[str] | None = None) -> int:
    """The `air-magic` console script."""
    from ..errors import ConfigurationError
    from ..tracking import orphans
    from .jobfile import JobFileError

    call_record.on_orphaned(orphans.fail_run)  # the first process to find a dead owner's call ends its MLflow run
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
