"""A dead Ray actor's worker process: how it exited and the last lines of its log, as an error about it says them.

Ray's `ActorDiedError` names the worker's pid, its node's ip and the exit Ray
saw (a type and a detail; the GCS's actor table also has the worker's id).
The raylet that started the worker learns no exit code or signal when the
process just ends: what the worker said before it died is in its own log,
`<session dir>/logs/worker-<worker id>-<job id>-<pid>.err` and `.out` on the
node that ran it (Ray's log monitor moves a dead worker's to `logs/old/`).
Where that node is this machine (its ip is this node's or a loopback one; a
simulated cluster's nodes share one session directory) the last lines of
both are quoted; elsewhere their place and the node are named. This runs
while an error is being reported: it never raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path

from . import _compat

#: The most lines, and characters, quoted of each of the worker's two logs.
TAIL_LINES = 20
TAIL_CHARS = 2000
#: What Ray's words say of the worker, by field (the first pattern found wins).
_SAID = {
    "pid": (r"\bpid: (\d+)", r"Worker PID: (\d+)"),
    "ip": (r"\bip: (\S+)", r"Worker IP address: (\S+)"),
    "worker_id": (r"Worker ID: ([0-9a-f]+)",),
    "node_id": (r"Node ID: ([0-9a-f]+)",),
    "exit_type": (r"Worker exit type: (\w+)",),
    "exit_detail": (r"Worker exit detail: (.{1,300}?)(?: Some common causes| There are some potential| The actor|$)",),
}
#: The lines Ray writes into a worker's log for its log monitor (which job and actor the lines that follow are of).
_RAY_TAGS = re.compile(r"^:(job_id|actor_name|task_name):")


@dataclasses.dataclass
class DeadWorker:
    """What is known of an actor's dead worker process ("" or 0 where nothing is)."""

    pid: int = 0
    ip: str = ""
    worker_id: str = ""
    node_id: str = ""
    exit_type: str = ""
    exit_detail: str = ""


def exit_and_log(exc: BaseException) -> str:
    """The sentences that say how the worker of the actor whose death `exc` is exited, and the tail of its log
    (or where that log is); "" where Ray's words name no worker."""
    with contextlib.suppress(Exception):
        dead = dead_worker(exc)
        if dead.pid or dead.worker_id:
            return f"{_exit(dead)}\n{_log(dead)}"
    return ""


def dead_worker(exc: BaseException) -> DeadWorker:
    """The worker of `exc`'s actor, from Ray's words and, for what they leave out, the cluster's actor table."""
    text = " ".join(str(exc).split())
    dead = DeadWorker()
    for field, patterns in _SAID.items():
        found = next((m.group(1) for p in patterns if (m := re.search(p, text))), "")
        setattr(dead, field, int(found) if field == "pid" and found else found)
    actor_id = getattr(exc, "actor_id", None)
    if actor_id and not (dead.pid and dead.worker_id):
        for field, value in (_compat.actor_worker(str(actor_id)) or {}).items():
            if value and not getattr(dead, field):
                setattr(dead, field, value)
    return dead


def _exit(dead: DeadWorker) -> str:
    """Which process died where, and its exit as far as Ray knows it."""
    named = (("Ray node", dead.node_id), ("worker", dead.worker_id))
    ids = ", ".join(f"{what} {value[:8]}" for what, value in named if value)
    said = f"The dead worker process: pid {dead.pid or '?'} on node {dead.ip or '?'}" + (f" ({ids})" if ids else "")
    if dead.exit_type or dead.exit_detail:
        said += f"; its exit, as Ray saw it: {dead.exit_type or '?'}" + (
            f", {dead.exit_detail.strip().rstrip('.')}" if dead.exit_detail else ""
        )
    if "connection error code" in dead.exit_detail:
        said += " (the process ended without a word to its node: no exit code or signal of it is known)"
    return said.rstrip(".") + "."


def _log(dead: DeadWorker) -> str:
    """The tail of the worker's .err and .out, or where they are when they are not on this machine."""
    name = f"worker-{dead.worker_id or '*'}-*-{dead.pid or '*'}"
    here = _compat.local_session()
    if here is None or (dead.ip and dead.ip != here[1] and not _loopback(dead.ip)):
        where = f"in {Path(here[0]) / 'logs'} " if here else "in the logs/ of Ray's session directory "
        return f"Its log is {name}.err and .out {where}on node {dead.ip or '?'} (not readable from this machine)"
    logs = Path(here[0]) / "logs"
    found = _newest(logs, f"{name}.err")
    if found is None:
        return f"No log {name}.err was found in {logs} or its old/"
    parts = []
    for path in (found, found.with_suffix(".out")):
        tail = _tail(path)
        parts.append(f"Its log {path} ends:\n{tail}" if tail else f"Its log {path} is empty")
    return "\n".join(parts)


def _newest(logs: Path, pattern: str) -> Path | None:
    """The latest written file of `pattern` in `logs` or `logs/old` (the log monitor moves a dead worker's there)."""
    found = [*logs.glob(pattern), *(logs / "old").glob(pattern)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _tail(path: Path) -> str:
    """The last lines of a worker's log, less Ray's tags, indented; "" for none or an unreadable file."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - 16 * TAIL_CHARS))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.strip() and not _RAY_TAGS.match(line)][-TAIL_LINES:]
    kept = "\n".join(f"    {line}" for line in lines)
    return kept if len(kept) <= TAIL_CHARS else "    ..." + kept[-TAIL_CHARS:]


def _loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"
