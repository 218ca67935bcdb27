"""`call.json`: a background call's record in its run directory, written when it ends, and the handle rebuilt
from it (`DistributedCall.from_run_dir`) after a kernel restart. The one owner of that format.

The record says what the call was (name, front door, ranks, accelerator type), how it ended, when, its MLflow
run, each rank's state and exit code, and its error in one line; the ranks' logs, results and error records
beside it (launch/files/rundir.py) give the rest. Not for: running anything again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import AirMagicError, JobCancelledError, RankFailedError
from .job import JobResult, JobSpec, JobStatus, RankResult, RankState
from .launch.files.rank_files import outcome
from .launch.files.rundir import RunDir

#: The record's file name in the run directory.
RECORD = "call.json"


def write(call: Any) -> None:
    """Write `call`'s record (a background.DistributedCall) into its run directory (nothing if it never had one)."""
    if call.ctx is None:
        return
    result = call.result_
    record = {
        "id": call.id,
        "name": call.spec.name,
        "origin": call.spec.origin,
        "world_size": call.spec.world_size,
        "accelerator_type": call.spec.accelerator_type,
        "status": call.status,
        "started": call.started,
        "ended": call.ended,
        "elapsed": result.elapsed if result is not None else call.elapsed,
        "run_id": call.run_id,
        "link": call.link,
        "returncodes": [r.returncode for r in result.ranks] if result is not None else [],
        "states": [r.state.value for r in result.ranks] if result is not None else [],
        "error": None if call.error is None else f"{type(call.error).__name__}: {call.error}",
    }
    try:
        (call.ctx.run_dir / RECORD).write_text(json.dumps(record))
    except OSError:
        pass


def _gone(*args: Any, **kwargs: Any) -> None:
    """The function of a call rebuilt from its run directory: it ran already, and is not here to run again."""
    raise AirMagicError("this call was rebuilt from its run directory; it cannot run again")


def rebuild(cls: Any, path: Path) -> Any:
    """An ended call's handle (of class `cls`, background.DistributedCall) from its run directory: status, record,
    logs, exit codes, results or error."""
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError) as exc:
        raise AirMagicError(f"{path} holds no air_magic call record ({RECORD}): {exc}") from None
    spec = JobSpec(
        target=_gone,
        args=(),
        kwargs={},
        name=record["name"],
        world_size=record["world_size"],
        accelerator_type=record["accelerator_type"],
        timeout=None,
        origin=record.get("origin", "function"),
    )
    call = cls(spec, listeners=[])
    call.id, call.status, call._record, call._run_dir = record["id"], record["status"], record, path
    call.started, call.ended = record["started"], record["ended"]
    run_dir = RunDir(path)
    ranks = [
        RankResult(r, RankState(state), returncode=code, log_path=run_dir.log(r))
        for r, (state, code) in enumerate(zip(record["states"], record["returncodes"], strict=False))
    ]
    finished = record["status"] == "finished"
    status = JobStatus.FINISHED if finished else JobStatus.FAILED if record["status"] == "failed" else JobStatus.KILLED
    result = JobResult(spec, path, ranks, status=status, elapsed=record["elapsed"])
    if record["status"] == "cancelled":
        result.error = JobCancelledError(f"{spec.name} was cancelled. Logs of every rank are in {path}.")
    elif not finished:
        errors = [outcome(run_dir, r.rank).error for r in ranks]
        result.error = next((e for e in errors if e is not None), None) or RankFailedError(str(record["error"]))
    else:
        import cloudpickle

        for rank in ranks:
            rank.value = cloudpickle.loads(outcome(run_dir, rank.rank).value or cloudpickle.dumps(None))
    call.result_, call.error = result, result.error
    call._done.set()
    return call
