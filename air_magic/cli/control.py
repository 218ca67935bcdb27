"""`air-magic cancel`, `stop` and `attach`: controlling and following runs from a terminal, each of them a call
of this user on the machine, whichever process started it.

`cancel ID... | --all [-y]` asks each run's owner to cancel it (`--all` lists the active runs and asks first,
unless `-y`); it exits 1 if a run could not be cancelled (not active). `stop ID` asks the ranks to stop after
their step (`air_magic.should_stop()`). `attach ID` follows a run from its first line and exits with its
state's code. Not for: reading runs (cli/show.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..calls import record as call_record
from .output import envelope, exit_code, state
from .reading import UsageError, failures, find, when

#: Seconds `cancel` waits for the calls it cancels to end, before it says they are still stopping.
CANCEL_WAIT = 20.0


def follow_text(path: Path, prompts: bool | None = None) -> int:
    """Follow the run's output on stdout until it ends; the exit code of its final state. A rank at a debugger prompt
    is answered from standard input with `prompts` (by default, when standard input is a terminal)."""
    from .mlflow_ui import on_server
    from .watch import follow

    def ending(final: dict[str, Any]) -> list[str]:
        lines = failures(path, final) if final.get("status") == call_record.FAILED else []
        if final.get("run_id") and not on_server(final):
            lines.append(f"air-magic: its MLflow UI ends with this command; `air-magic ui {path.name}` serves it again")
        return lines

    answer = sys.stdin is not None and sys.stdin.isatty() if prompts is None else prompts
    final = follow(path, out=sys.stdout, ending=ending, prompts=answer)
    return exit_code(state(path, final))


def follow_any(path: Path, as_json: bool) -> int:
    if as_json:
        from .events import follow_json

        return exit_code(state(path, follow_json(path, sys.stdout)))
    return follow_text(path)


def _confirm(paths: list[Path]) -> bool:
    print("Run ID / Experiment / Started")
    for path in paths:
        record = call_record.load(path) or {}
        print(f"  {path.name}  {record.get('name')}  {when(record.get('started'))}")
    try:
        answer = input(f"Cancel these {len(paths)} run(s)? [y/N] ")
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def cmd_cancel(args: argparse.Namespace) -> int:
    if not args.ids and not args.all:
        raise UsageError("cancel needs run ids, or --all for every active run")
    if args.all:
        paths = [Path(r["run_dir"]) for r in call_record.all_records() if r.get("status") in call_record.LIVE]
        if paths and not args.yes and not _confirm(paths):
            print("air-magic: nothing cancelled", file=sys.stderr)
            return 1
    else:
        paths = [find(i) for i in args.ids]
    cancelled, failed = [], []
    for path in paths:
        record = call_record.load(path) or {}
        if record.get("status") in call_record.LIVE:
            call_record.request_cancel(path)
            cancelled.append(path)
        else:
            failed.append({"run_id": path.name, "error": f"run is not active ({state(path, record)})"})
    if args.json:
        print(envelope({"cancelled": [p.name for p in cancelled], "all": bool(args.all), "failed": failed}))
        return 1 if failed else 0
    if not paths:
        print("air-magic: no run is waiting or running; nothing to cancel")
        return 0
    ended = _wait_ended(cancelled, CANCEL_WAIT)
    for path in cancelled:
        print(
            f"Successfully requested cancellation for run {path.name}" + ("" if path.name in ended else " (stopping)")
        )
    for entry in failed:
        print(f"{entry['run_id']}: {entry['error']}; nothing to cancel")
    return 1 if failed else 0


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
        print(envelope({"run_id": path.name, "stop_requested": bool(live), "already_requested": live and not asked}))
    else:
        print(f"{path.name}: {'stop requested (should_stop() is True on every rank)' if live else 'not running'}")
    return 0


def cmd_attach(args: argparse.Namespace) -> int:
    if args.json:
        return follow_any(find(args.id), True)
    return follow_text(find(args.id), prompts=True)  # a rank at breakpoint() is answered here
