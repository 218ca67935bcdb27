"""What the command line prints for scripts: the runtime's states, its JSON envelope and error envelope, its
event lines, and the exit code of a state.

A call's status (calls/record.py: waiting, running, finished, failed, cancelled) is said as the runtime's
state: PENDING, RUNNING, SUCCESS, FAILED, TIMEDOUT or CANCELED; a run whose last attempt ran past its
`timeout_minutes` is TIMEDOUT. `-o json` prints `{"v":1,"ts":...,"data":{...}}`, or on an error
`{"v":1,"ts":...,"error":{"code","kind","message","retryable"}}`; `--watch -o json` and `logs -o json` print
one event a line (`SUBMITTED`, `STATUS`, `LOG`, `ALERT`). Exit codes: 0 SUCCESS, 1 any other end, 2 a bad
command line or workload file. Not for: reading the run directory (cli/reading.py, cli/files.py).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from ..calls import record as call_record
from .files import WorkloadDir

#: The runtime's state of each call status.
STATES = {
    call_record.WAITING: "PENDING",
    call_record.RUNNING: "RUNNING",
    call_record.FINISHED: "SUCCESS",
    call_record.FAILED: "FAILED",
    call_record.CANCELLED: "CANCELED",
}
#: States in which a run goes on.
ACTIVE = ("PENDING", "RUNNING")


def state(path: Path, record: dict[str, Any]) -> str:
    """The runtime's state of the call of run directory `path`."""
    status = str(record.get("status"))
    if status == call_record.FAILED:
        files = WorkloadDir(path)
        attempts = files.attempts()
        nodes = int((files.read_info() or {}).get("num_nodes") or 1)
        if attempts and any(files.read_end(attempts[-1], n).get("timed_out") for n in range(nodes)):
            return "TIMEDOUT"
        if "timed out" in str(record.get("error") or ""):  # a node of another machine, or a function's call
            return "TIMEDOUT"
    return STATES.get(status, "UNKNOWN")


def run_fields(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    """A run as JSON: air_magic's fields of the call (cli/reading.py's summary, its MLflow run as
    `mlflow_run_id`), then the runtime's: `run_id` (the call's id), `status` (its state), `dashboard_url`."""
    from .reading import summary

    fields = summary(record)
    fields["mlflow_run_id"] = fields.pop("run_id", None)
    fields["air_magic_status"] = fields.pop("status", None)
    return {**fields, "run_id": path.name, "status": state(path, record), "dashboard_url": record.get("link")}


def exit_code(run_state: str) -> int:
    """0 on SUCCESS, 1 on any other end."""
    return 0 if run_state == "SUCCESS" else 1


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def iso(seconds: float | None) -> str | None:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat() if seconds else None


def line(value: dict[str, Any]) -> str:
    return json.dumps(value, default=str)


def envelope(data: Any) -> str:
    """The runtime's success envelope around `data`."""
    return line({"v": 1, "ts": now(), "data": data})


def event(type_: str, **fields: Any) -> str:
    """One event line: {"type": type_, "ts": ..., **fields}."""
    return line({"type": type_, "ts": now(), **fields})


#: (code, kind, retryable) of each error class's name.
ERROR_KINDS = {
    "JobFileError": ("INVALID_ARGS", "PERMANENT", False),
    "UsageError": ("INVALID_ARGS", "PERMANENT", False),
    "ConfigurationError": ("INVALID_ARGS", "PERMANENT", False),
    "NotFound": ("NOT_FOUND", "NOT_FOUND", False),
}


def error_envelope(exc: BaseException) -> str:
    """The runtime's error envelope of `exc`."""
    code, kind, retryable = ERROR_KINDS.get(type(exc).__name__, ("INTERNAL_ERROR", "TRANSIENT", True))
    return line(
        {"v": 1, "ts": now(), "error": {"code": code, "kind": kind, "message": str(exc), "retryable": retryable}}
    )
