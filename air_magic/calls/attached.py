"""A call of another process, reached through its run directory: `air_magic.attach(ID)` and `%distributed_attach`.

`AttachedCall` is a `DistributedCall` that reads the call's record and files instead of running it: its
status follows the live record (record.py), a command run's alerts its nodes' `alerts.jsonl` (`command_alerts`),
`result()` waits for the final record and reads each rank's value or error from the run directory, `cancel()`
leaves the cancel request the owner polls, `stop()` the Stop flag, and `show()` draws the live panel with every
line the ranks wrote so far (display/follow.py), fed by a thread that follows the files. Any kernel of the same
user may attach: the call's owner may be a detached call's process, a command-line run or another kernel.
`machine_table()` is `%distributed_calls --all`: every call of this user on the machine. Not for: running a call
(detached.py).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..job import Alert, RankState
from ..launch.files import command_logs
from ..launch.files.rundir import RunDir
from ..listeners import RunContext
from . import record as call_record
from .handle import DistributedCall
from .rebuilt import rebuild, spec_of

#: Seconds between two looks at an attached call's record.
_LOOK = 0.2


class AttachedCall(DistributedCall):
    """The handle of a call that another process owns, following its run directory."""

    def __init__(self, path: Path, owner: Any) -> None:
        record = call_record.load(path)
        if record is None:
            raise call_record.AirMagicError(f"{path} holds no air_magic call record")
        spec = spec_of(record)
        super().__init__(spec, listeners=[], owner=owner)
        self.id = path.name  # type: ignore[assignment]
        self._run_dir, self._record = path, record
        self.started = record.get("started") or time.time()
        self.status = record["status"]
        self.waiting_for = record.get("waiting_for") or ""
        self.ctx = RunContext(spec, path, RunDir(path).logs(spec.world_size))
        self.ctx.started_at -= max(0.0, time.time() - self.started)  # the panel's clock: from the call's start
        for rank in range(spec.world_size):
            self.watch.states[rank] = RankState.RUNNING if self.status == call_record.RUNNING else RankState.PENDING
        self._cancel_sent = False
        self._command = command_logs.is_command_run(path)  # its alerts are its nodes' (`command_alerts`)
        has_run_dir = getattr(self, "_has_run_dir", None)  # the run directory exists: nothing to wait for
        if has_run_dir is not None:
            has_run_dir.set()
        self._follow()
        owner.table.add(self)  # %distributed_calls, %distributed_show N and %distributed_stop N reach it here
        threading.Thread(target=self._follow_loop, name=f"air_magic-attached-{path.name}", daemon=True).start()

    def _follow(self) -> bool:
        """Read the record once; True when the call has ended (its result is then set)."""
        record = call_record.load(self.run_dir) or self._record
        self._record = record
        if self.ctx is not None and self.ctx.cancelled and not self._cancel_sent:
            self.cancel()
        if record.get("status") == call_record.RUNNING and self.status != call_record.RUNNING:
            for rank in range(self.spec.world_size):
                self.watch.on_rank_state(rank, RankState.RUNNING)
        self.status, self.waiting_for = record["status"], record.get("waiting_for") or ""
        if record.get("run_id") and self.ctx is not None and "mlflow" not in self.ctx.links:
            link = self.owner.link_of(record)  # this kernel's UI over the call's store: the owner's ends with it
            if link:
                self.ctx.links["mlflow"] = link
        alerts = command_alerts(self.run_dir) if self._command else []
        if self.ctx is not None and len(alerts) > len(self.ctx.alerts):
            self.ctx.alerts[:] = alerts  # the panel shows them at its next poll
        if self.status in call_record.LIVE:
            return False
        ended = rebuild(DistributedCall, self.run_dir)
        if self._command:
            ended.result_.alerts = alerts
        self.result_, self.error, self.ended = ended.result_, ended.error, record.get("ended") or time.time()
        return True

    def _follow_loop(self) -> None:
        while not self._done.is_set():
            try:
                ended = self._follow()
            except Exception:  # noqa: BLE001 - a record half written is read again at the next look
                ended = False
            self.watch.poll()
            if ended:
                assert self.result_ is not None
                self.watch.on_end(self.result_)
                self._done.set()
                self.owner.table.ended(self)
                return
            time.sleep(_LOOK)

    def cancel(self) -> None:
        """Ask the call's owner (whatever process it is) to stop every rank; `.result()` then raises
        JobCancelledError."""
        self._cancel_sent = True
        call_record.request_cancel(self.run_dir)

    @property
    def run_dir(self) -> Path:
        assert self._run_dir is not None
        return self._run_dir

    @property
    def run_id(self) -> str | None:
        return self._record.get("run_id")

    def __repr__(self) -> str:
        return f"<DistributedCall {self.id} {self.spec.name}: {self.status}>"


def command_alerts(path: Path) -> list[Alert]:
    """A command run's alerts as its nodes raised them (launch/files/command_logs.py): the watch's of the ranks its
    command started, under that rank, and the fatal lines of a node's output, under the node's first rank."""
    per_node = int(command_logs.info(path).get("per_node") or 1)
    found = []
    for entry in command_logs.alerts(path):
        kind, line, node = str(entry.get("kind")), str(entry.get("line") or ""), int(entry.get("node") or 0)
        rank = entry.get("rank")
        if line.startswith(command_logs.WATCH_PREFIX):
            message = line[len(command_logs.WATCH_PREFIX) :].partition(": ")[2]
            cause = "no progress" if kind == "hang" else "input" if "its input" in message else "compute"
        else:
            message, cause = f"node {node}: {kind}: {line.strip()[:300]}", "output"
        at = rank if isinstance(rank, int) else node * per_node
        found.append(Alert(kind, at, cause, message, float(entry.get("time") or 0.0)))
    return found


def shown(call: AttachedCall) -> AttachedCall:
    """`call`, its panel drawn in the running cell when there is one (in IPython)."""
    ipython = sys.modules.get("IPython")
    if ipython is not None and ipython.get_ipython() is not None:
        call.show()
    return call


def attach(call_id: str, show: bool, owner: Any) -> DistributedCall:
    """The handle of call `call_id` (its id, a unique prefix of it, or its run directory), which any process of
    this user on this machine may run: a detached call, a command-line run or another kernel's call; in `owner`'s
    table (air_magic.owner.Owner) from now on, its panel drawn here unless `show` is False."""
    call = AttachedCall(call_record.find_dir(str(call_id)), owner)
    return shown(call) if show else call


def machine_table() -> str:
    """`%distributed_calls --all`: one line per call of this user on the machine, oldest first."""
    records = call_record.all_records()
    if not records:
        return "No air_magic call on this machine yet."
    width = max(len(r["id"]) for r in records)
    lines = [f"{'id':<{width}} {'call':<20} {'status':<10} {'ranks':<6} {'owner':<14} started"]
    for r in records:
        owner = r.get("owner") or {}
        who = f"{owner.get('role', '-')} {owner.get('pid', '')}".strip()
        when = time.strftime("%m-%d %H:%M:%S", time.localtime(r.get("started") or 0))
        lines.append(
            f"{r['id']:<{width}} {str(r.get('name'))[:20]:<20} {r.get('status', '?'):<10} "
            f"{r.get('world_size', '?')!s:<6} {who:<14} {when}"
        )
    return "\n".join(lines)
