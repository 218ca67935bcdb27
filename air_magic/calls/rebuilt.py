"""A call's handle rebuilt from its record (`DistributedCall.from_run_dir`, an attached call's end): its status,
logs, exit codes, alerts, and the values or the error its ranks left. It reads `call.json` through record.py, the
format's one owner, and writes nothing. Not for: a live call (handle.py) or following one (attached.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import AirMagicError, JobCancelledError, RankFailedError
from ..job import Alert, JobResult, JobSpec, JobStatus, RankResult, RankState
from ..launch.files.rank_files import outcome
from ..launch.files.rundir import RunDir
from .record import RECORD, load


def _gone(*args: Any, **kwargs: Any) -> None:
    """The function of a call rebuilt from its run directory: it ran already, and is not here to run again."""
    raise AirMagicError("this call was rebuilt from its run directory; it cannot run again")


def spec_of(record: dict[str, Any]) -> JobSpec:
    """The job a record describes, as a handle rebuilt from disk shows it (its function is not here to run)."""
    return JobSpec(
        target=_gone,
        args=(),
        kwargs={},
        name=record["name"],
        world_size=record["world_size"],
        accelerator_type=record["accelerator_type"],
        timeout=None,
        origin=record.get("origin", "function"),
        num_nodes=record.get("num_nodes", 1),
    )


def rebuild(cls: Any, path: Path) -> Any:
    """An ended call's handle (of class `cls`, handle.DistributedCall) from its run directory: status, record,
    logs, exit codes, results or error."""
    record = load(path)
    if record is None:
        raise AirMagicError(f"{path} holds no air_magic call record ({RECORD}) that can be read") from None
    spec = spec_of(record)
    call = cls(spec, listeners=[])
    call.id, call.status, call._record, call._run_dir = path.name, record["status"], record, path
    if isinstance(record.get("number"), int) and hasattr(call, "number"):
        call.number = record["number"]
    call.started, call.ended = record.get("started") or 0.0, record.get("ended")
    run_dir = RunDir(path)
    states, codes = record.get("states") or [], record.get("returncodes") or []
    if not states:  # its owner died before it ended: no rank left a state
        states, codes = ["stopped"] * record["world_size"], [None] * record["world_size"]
    ranks = [
        RankResult(r, RankState(state), returncode=code, log_path=run_dir.log(r))
        for r, (state, code) in enumerate(zip(states, codes, strict=False))
    ]
    finished = record["status"] == "finished"
    status = JobStatus.FINISHED if finished else JobStatus.FAILED if record["status"] == "failed" else JobStatus.KILLED
    result = JobResult(spec, path, ranks, status=status, elapsed=record.get("elapsed") or 0.0)
    result.alerts = [Alert(**a) for a in record.get("alerts") or () if isinstance(a, dict)]
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
