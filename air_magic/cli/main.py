"""`air-magic`: the command line, a thin skin over the same owner of calls as the notebook.

`run -f job.yaml` takes the runtime's workload file (cli/jobfile.py) and starts it as a detached call
(cli/submit.py); `list`, `get` and `logs` read every call of this user on the machine (cli/show.py), `cancel`,
`stop` and `attach` control and follow them (cli/control.py), `stacks` asks a command run's ranks where they are
(cli/rank_stacks.py), and `ui` serves the MLflow UI of a local store
(cli/mlflow_ui.py). `-o json` (or `--json`), anywhere on the line, prints the runtime's JSON envelope; the
docs' forms `get run ID` and `list runs [--active]` are the same commands. Exit codes: 0 a run that ended
SUCCESS (or a command that did what it was asked), 1 any other end, 2 a bad command line, workload file or
run id (nothing started).
"""

from __future__ import annotations

import argparse
import sys

from ..errors import AirMagicError
from .mlflow_ui import cmd_ui
from .output import error_envelope
from .reading import UsageError


def normalize(argv: list[str]) -> tuple[list[str], bool]:
    """`argv` without `-o json`/`--output json`/`--json` (which may come anywhere), the docs' aliases made the
    commands they name; and whether JSON was asked."""
    out: list[str] = []
    as_json = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--override", "-f", "--file", "--filter") and i + 1 < len(argv):
            out += [arg, argv[i + 1]]
            i += 2
            continue
        value = None
        if arg in ("-o", "--output") and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        elif arg.startswith("--output="):
            value = arg.partition("=")[2]
        elif arg.startswith("-o") and len(arg) > 2:
            value = arg[2:]
        elif arg == "--json":
            value = "json"
        if value is None:
            out.append(arg)
        elif value in ("json", "text"):
            as_json = value == "json"
        else:
            raise UsageError(f"-o {value!r}: the output is text or json")
        i += 1
    if out[:2] in (["get", "run"], ["list", "runs"], ["logs", "run"], ["cancel", "run"]):
        del out[1]
    return out, as_json


def parser() -> argparse.ArgumentParser:
    from .control import cmd_attach, cmd_cancel, cmd_stop
    from .rank_stacks import cmd_stacks
    from .show import cmd_get, cmd_list, cmd_logs
    from .submit import cmd_run

    top = argparse.ArgumentParser(
        prog="air-magic",
        description="Run the runtime's workload files on this machine (`command` once per node), and see or "
        "control every air_magic call of this user on it: the command line's and every notebook's.",
        epilog="ID is a run's id (`air-magic list --all-status`), or a unique start of it. -o json (or --json), "
        "anywhere: the runtime's JSON envelope. Exit codes: 0 SUCCESS, 1 any other end, 2 a bad command line, "
        "workload file or ID (nothing started).",
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, more: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=f"{help} {more}".strip())

    run = add(
        "run",
        "Run a workload file; prints the run's id and returns (or follows it with --watch).",
        "The file is the runtime's (experiment_name, compute, command, environment, env_variables, secrets, "
        "code_source, max_retries, timeout_minutes, idempotency_token, parameters, mlflow_run_name, ...); "
        "docs/cli.md lists every field and what differs on one machine.",
    )
    run.add_argument("-f", "--file", required=True, help="The workload file (YAML).")
    run.add_argument("--watch", action="store_true", help="Follow every node's output; exit 0 on SUCCESS, else 1.")
    run.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Change a field, as often as needed: compute.accelerator_type=CPU",
    )
    run.add_argument("--dry-run", action="store_true", help="Check the file and say what would run; start nothing.")
    run.add_argument("--idempotency-key", default=None, metavar="KEY", help="A repeat run with KEY starts nothing.")
    run.set_defaults(func=cmd_run)
    listing = add("list", "Runs of this user on this machine, newest first: active ones unless --all-status.")
    listing.add_argument("--limit", type=int, default=20, metavar="N", help="At most N runs (default 20).")
    listing.add_argument("--all-status", action="store_true", help="Ended runs too.")
    listing.add_argument("--active", action="store_true", help="Active runs only (the default).")
    listing.add_argument(
        "--filter", action="append", default=[], metavar="KEY=VALUE", help="experiment=GLOB, accelerator_type=..."
    )
    listing.set_defaults(func=cmd_list)
    get = add("get", "One run: state, attempt, MLflow run, alerts, each rank's value or error.")
    get.add_argument("id", metavar="ID", help="The run's id (a unique prefix is enough).")
    get.add_argument("--watch", action="store_true", help="Wait for the run's end; exit 0 on SUCCESS, else 1.")
    get.set_defaults(func=cmd_get)
    logs = add("logs", "What a node of a run wrote (node 0 of the latest attempt unless told).")
    logs.add_argument("id", metavar="ID", help="The run's id (a unique prefix is enough).")
    logs.add_argument("--node", type=int, default=None, metavar="N", help="Node N (command runs; default 0).")
    logs.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="Rank R's own log: a function run's rank, or the rank of RANK R that the command's torchrun (or "
        "accelerate launch) started; with --node N, a check that it ran there.",
    )
    logs.add_argument("--retry", type=int, default=-1, metavar="A", help="Attempt A (from 0; -1 the latest).")
    logs.add_argument("--lines", type=int, default=None, metavar="N", help="The last N lines only.")
    logs.add_argument(
        "--minutes", type=int, default=None, metavar="M", help="The lines written in the last M minutes only."
    )
    logs.add_argument("--follow", action="store_true", help="Follow until the run ends; exit 0 on SUCCESS, else 1.")
    logs.add_argument("--download-to", default=None, metavar="DIR", help="Write DIR/logs/node_<n>.log.")
    logs.set_defaults(func=cmd_logs)
    cancel = add("cancel", "Cancel runs now (every node's processes stop).")
    cancel.add_argument("ids", nargs="*", metavar="ID", help="Runs to cancel.")
    cancel.add_argument("--all", action="store_true", help="Every active run of this user (asks first).")
    cancel.add_argument("-y", "--yes", action="store_true", help="With --all: do not ask.")
    cancel.set_defaults(func=cmd_cancel)
    stop = add("stop", "Ask a run's ranks to stop after their current step (air_magic.should_stop()).")
    stop.add_argument("id", metavar="ID", help="The run's id (a unique prefix is enough).")
    stop.set_defaults(func=cmd_stop)
    stacks = add(
        "stacks",
        "Print where each rank of a running command run is: every thread's Python stack.",
        "The ranks are those the command's torchrun (or accelerate launch) started in the latest attempt.",
    )
    stacks.add_argument("id", metavar="ID", help="The run's id (a unique prefix is enough).")
    stacks.add_argument("--rank", type=int, default=None, metavar="R", help="Rank R only.")
    stacks.add_argument(
        "--wait", type=float, default=5.0, metavar="S", help="Wait up to S seconds for the dumps (default 5)."
    )
    stacks.set_defaults(func=cmd_stacks)
    attach = add(
        "attach",
        "Follow a run's output live from its first line, answering a rank stopped at breakpoint() from standard "
        "input; exit 0 on SUCCESS, else 1.",
    )
    attach.add_argument("id", metavar="ID", help="The run's id (a unique prefix is enough).")
    attach.set_defaults(func=cmd_attach)
    ui = add(
        "ui",
        "Serve the MLflow UI of this machine's local store on 127.0.0.1 until Ctrl-C.",
        "With ID, the store of that run's MLflow run, and the link that opens it. A store that is a server needs "
        "none: its link is printed.",
    )
    ui.add_argument(
        "id", nargs="?", default=None, metavar="ID", help="A run whose MLflow run to open (a unique prefix is enough)."
    )
    ui.set_defaults(func=cmd_ui)
    return top


def main(argv: list[str] | None = None) -> int:
    """The `air-magic` console script."""
    from ..calls import record as call_record
    from ..errors import ConfigurationError
    from ..tracking import orphans
    from .schema import JobFileError

    call_record.on_orphaned(orphans.fail_run)  # the first process to find a dead owner's call ends its MLflow run
    as_json = False
    try:
        words, as_json = normalize(list(sys.argv[1:] if argv is None else argv))
        args = parser().parse_args(words)
        args.json = as_json
        return int(args.func(args))
    except (JobFileError, UsageError, ConfigurationError) as exc:
        print(error_envelope(exc)) if as_json else print(f"air-magic: error: {exc}", file=sys.stderr)
        return 2
    except AirMagicError as exc:
        print(error_envelope(exc)) if as_json else print(f"air-magic: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `air-magic list | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
