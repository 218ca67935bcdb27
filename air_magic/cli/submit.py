"""`air-magic run -f job.yaml`: check the workload file, say what would run (`--dry-run`), or start it as a
detached call (calls/detached.py) and print its id, or follow it (`--watch`).

A repeat `run` with the same `idempotency_token` (or `--idempotency-key`) returns the existing run and starts
nothing. Fields with no meaning on one machine are named in one notice line on stderr; each `--override` says
what it changed. What the environment lacks of the file's dependencies is installed first, into a cached
environment (cli/layer.py), in one line. Not for: the file's fields (cli/jobfile.py) or following a run
(cli/watch.py, cli/events.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..calls import record as call_record
from ..launch.files.rundir import runs_root
from .files import WorkloadDir
from .output import envelope, exit_code, run_fields, state
from .reading import UsageError


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def existing(token: str) -> Path | None:
    """The run directory of the run submitted with idempotency token `token`, if there is one."""
    root = runs_root()
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.is_dir() and (WorkloadDir(path).read_info() or {}).get("idempotency_token") == token:
            return path
    return None


def _dry_run(job: Any, as_json: bool) -> int:
    described = job.describe()
    if as_json:
        print(envelope({"status": "DRY_RUN_OK", "dry_run": True, **described}))
        return 0
    print(f'Dry run: configuration for "{job.experiment_name or job.name}" is valid; not submitting.')
    for key, value in described.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        elif isinstance(value, list):
            value = ", ".join(str(v) for v in value) or "-"
        print(f"  {key}: {value}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from ..owner import DETACHED, owner
    from .jobfile import load

    job = load(args.file, args.override, say=_say)
    if args.idempotency_key is not None:
        if not 0 < len(args.idempotency_key) <= 64:
            raise UsageError("--idempotency-key must be 1 to 64 characters")
        job.data["idempotency_token"] = args.idempotency_key
    if job.notices:
        _say(f"air-magic: notice: no meaning on this machine, ignored: {', '.join(job.notices)}")
    if args.dry_run:
        return _dry_run(job, args.json)
    token = job.idempotency_token
    found = existing(token) if token else None
    if found is not None:
        record = call_record.load(found) or {}
        if args.json and not args.watch:
            print(envelope({**run_fields(found, record), "existing": True}))
        else:
            _say(f"air-magic: run {found.name} has idempotency token {token!r} already; nothing started")
            if not args.watch:
                print(f"Submitted workload with Run ID: {found.name}")
        return _watch(found, args.json, submitted=False) if args.watch else 0
    job.resolve_secrets()
    job.install(_say)  # what the environment lacks, into the cached environment, before anything starts
    spec = job.spec()
    if not args.json:
        print(f"Submitting experiment: {job.experiment_name or job.name}", flush=True)
    path = owner("cli").submit(
        spec, DETACHED, role="cli", experiment_name=job.experiment_name, cwd=str(job.root), prepare=job.prepare
    )
    record = call_record.load(path) or {}
    if args.json and not args.watch:
        print(envelope(run_fields(path, record)))
        return 0
    if not args.json:
        print(f"Submitted workload with Run ID: {path.name}")
        print(f"Run directory: {path}", flush=True)
        if not args.watch:
            print(f"Tip: use --watch to follow it, or `air-magic logs {path.name} --follow`")
            return 0
    return _watch(path, args.json, submitted=True)


def _watch(path: Path, as_json: bool, submitted: bool) -> int:
    if as_json:
        from .events import follow_json

        final = follow_json(path, sys.stdout, submitted=submitted)
        return exit_code(state(path, final))
    from .control import follow_text

    return follow_text(path)
