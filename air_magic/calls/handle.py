"""Every call's handle, `DistributedCall`: `fn.spawn(...)` and `%%distributed --background` return one at once; a
foreground call (the owner's `submit`, air_magic/owner/) has one too, finished when its cell returns.

A background call takes the same path (the owner's `run` -> runner -> launcher) on a thread of its own, in a copy of the
spawning cell's context (its display writes to that cell), so the kernel is free; it has no Ctrl-C (`.cancel()` or
the panel's button). Its GPUs or CPU slots come from the ledger (ledger.py): it is `waiting` until they are free.
Its run directory, whose name is its id, is made when it is spawned.

Every handle is in the process's table of calls (table.py); it learns what the runner does through the listener
it puts first (handle_listener.py). `%distributed_calls` is display/calls.py; the record
on disk and the handle rebuilt from it, record.py; a panel drawn again, display/follow.py. No IPython here.

Over 300 lines because one handle answers all users ask of a call (status, result, logs, panel, stop, rebuilding).
"""

from __future__ import annotations

import contextvars
import dataclasses
import sys
import threading
import time
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import payload
from ..errors import AirMagicError, ConfigurationError
from ..job import Alert, CallStatus, JobResult, JobSpec
from ..launch.files.rundir import RunDir
from ..listeners import Listener, RunContext
from .handle_listener import HandleListener
from .record import RUNNING, WAITING, CallRecord, LiveRecord
from .table import CallTable

if TYPE_CHECKING:
    from ..profiling.profile import Profile

#: Seconds a running call may take to make its run directory before `run_dir` gives up with an error.
RUN_DIR_WAIT = 120.0


class DistributedCall:
    """A call: its status, result, logs, MLflow run and panel.

    Made by `fn.spawn(...)` or `%%distributed --background` (it runs on a thread of its own), and by every
    foreground call (finished when the cell returns); `DistributedCall.from_run_dir(path)` rebuilds the handle of
    an ended call from its run directory. `id` is the run directory's name (unique on the machine; until the call
    has one, its number); `number` is its small number in this process (table.py).
    """

    def __init__(
        self,
        spec: JobSpec,
        listeners: list[Listener] | None = None,
        owner: Any = None,
        record: CallRecord | None = None,
        recorded: bool = True,
    ) -> None:
        #: The owner of calls of the process that made it (air_magic.owner.Owner): its table, its one door.
        self.owner = owner
        self.number = 0
        self._id: str | int | None = None
        self.background = True
        self.spec = spec
        self.status = WAITING
        self.started = time.time()
        self.ended: float | None = None
        self.ctx: RunContext | None = None
        self.result_: JobResult | None = None
        self.error: BaseException | None = None
        self.waiting_for = ""
        self._cancel_asked = False
        self._done = threading.Event()
        self._has_run_dir = threading.Event()  # set once the call started (or ended)
        self._run_dir: Path | None = None
        self._record: dict[str, Any] = {}
        self.watch = HandleListener(self)
        self.listeners = listeners
        self.claim: Any = None  # its claim on the owner's ledger (owner/claims.py), once it has one
        #: The one writer of its `call.json` (made with its run directory, or handed over begun: a detached call's).
        self.record = record
        #: Whether it leaves a record on disk (a session's push, pull and reset do not).
        self.recorded = recorded
        self.live: LiveRecord | None = None
        #: What each `profile()` of this running call found, newest last.
        self.profiles: list[Profile] = []

    # -- who it is -----------------------------------------------------------
    @property
    def id(self) -> str | int:
        """The call's id: its run directory's name once it has one (unique on the machine), else its number."""
        if self._id is not None:
            return self._id
        return self.run_dir_name or self.number

    @id.setter
    def id(self, value: str | int) -> None:
        self._id = value

    @property
    def run_dir_name(self) -> str | None:
        """The run directory's name (the call's id), or None before the call has one."""
        path = self._run_dir or (self.ctx.run_dir if self.ctx is not None else None)
        return path.name if path is not None else None

    @property
    def session(self) -> str | None:
        return self.spec.session

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def short(self) -> str | int:
        """How messages name the call: its number in this process, else its id (a call of another process)."""
        return self.number or self.id

    def describe(self) -> str:
        """'background call 2 (train)': the call, as an error naming what holds a session says it."""
        return f"{'background ' if self.background else ''}call {self.short} ({self.spec.name})"

    def began(self, ctx: RunContext) -> None:
        """The runner started the call in `ctx`: it runs, its run directory exists, a cancel asked already goes on."""
        self.ctx = ctx
        self.status = RUNNING
        self._has_run_dir.set()
        if self._cancel_asked:
            ctx.cancel()

    @property
    def cancel_asked(self) -> bool:
        """A Cancel was asked (`cancel()`, the panel's button), perhaps before the call started."""
        return self._cancel_asked

    def named(self, path: Path) -> None:
        """The call's run directory (its id) is `path`, made before it takes its units; its record's writer, driven
        by the listener put last (the final line is written once the others are done)."""
        self._run_dir = self._run_dir or path
        if self.record is None:
            self.record = CallRecord(self._run_dir, self.owner.role if self.owner is not None else "kernel")
        if self.recorded and self.listeners is not None and self.live is None:
            self.live = LiveRecord(self.record, self.listeners, {"number": self.number})
            self.listeners.append(self.live)

    @property
    def table(self) -> CallTable:
        """The table of calls of the process that made it."""
        if self.owner is None:
            raise AirMagicError(f"call {self.short} was rebuilt from its run directory: it is in no table")
        table: CallTable = self.owner.table
        return table

    # -- starting ----------------------------------------------------------
    def start(self, wait: bool = True) -> DistributedCall:
        """Take the call's GPUs or slots (or queue for them), then run it on a thread; returns at once."""
        self.table.check_free(self.spec.session, self)
        payload.serialize(self.spec.target, self.spec.args, self.spec.kwargs)  # fails here, before anything starts
        self.table.add(self)
        self.listeners = self.listeners if self.listeners is not None else []
        try:
            self.named(RunDir.create(self.spec.name, self.spec.world_size).path)  # its id, from now on
            assert self._run_dir is not None and self.record is not None
            self.claim = self.owner.claim(self.spec, self._run_dir.name)
            if not self.claim.try_now():
                self.waiting_for = self.claim.why_waiting()
                if not wait:
                    raise ConfigurationError(
                        f"{self.spec.name} would wait for {self.waiting_for}; it was asked not to wait (wait=False)."
                    )
            # every process sees it wait
            self.record.begin(self.spec, WAITING, waiting_for=self.waiting_for, number=self.number)
        except BaseException as exc:
            self.error = exc
            if self.claim is not None:
                self.claim.release()
            if self._run_dir is not None and (self.record is None or not self.record.begun):
                RunDir(self._run_dir).remove()  # refused before it was anything: nothing of it is left
            self._end()
            raise
        self.listeners.insert(0, self.watch)  # first: the handle has the call's context as soon as it exists
        self.status = WAITING if self.waiting_for else RUNNING
        if self.waiting_for:
            print(f"air_magic: call {self.number} ({self.spec.name}) waits for {self.waiting_for}", file=sys.stdout)
            self._say_waiting()
        context = contextvars.copy_context()
        name = f"air_magic-call-{self.number}"
        threading.Thread(target=context.run, args=(self._run,), name=name, daemon=True).start()
        return self

    def run_here(self, run_dir: Any = None, on_wait: Any = None) -> JobResult:
        """Run a foreground call on this thread (the handle is in the table, finished when this returns), through
        its owner's `run`; its JobResult. A refused call raises."""
        self.background = False
        self.table.add(self)
        self.listeners = self.listeners if self.listeners is not None else []
        self.listeners.insert(0, self.watch)
        self.status = RUNNING
        try:
            result = self.result_ = self.owner.run(self, run_dir=run_dir, on_wait=on_wait)
            self.error = result.error
            return result
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self._end()
            self._let_go()

    def _let_go(self) -> None:
        """A foreground call's handle stays in the table (its number, id, status, record), without what its caller
        has already: its arguments, the values its ranks returned, its listeners (display, MLflow, sampler)."""
        self._record.update(run_id=self.run_id, link=self.link)
        self._run_dir, self.ctx = self._run_dir or (self.ctx.run_dir if self.ctx else None), None  # ctx holds the spec
        self.listeners, self.watch.followers = [], []
        self.spec = dataclasses.replace(self.spec, args=(), kwargs={})
        if self.result_ is not None:
            ranks = [dataclasses.replace(rank, value=None) for rank in self.result_.ranks]
            self.result_ = dataclasses.replace(self.result_, spec=self.spec, ranks=ranks)

    def _say_waiting(self) -> None:
        """The line a panel shows first says what the call waits for, until the panel takes its place."""
        for listener in self.listeners or ():
            starting = getattr(listener, "starting", None)
            if starting is not None and getattr(starting, "handle", None) is not None:
                starting.taken = True  # kept when the cell ends: the panel takes its place once the call starts
                text = f"{self.spec.name} · call {self.number} · waiting for {self.waiting_for}"
                starting.handle.update(
                    {"text/html": f'<div class="air-magic-starting">{escape(text)}</div>', "text/plain": text},
                    raw=True,
                )

    def _run(self) -> None:
        assert self.claim is not None and self.listeners is not None
        try:
            self.claim.wait(cancelled=lambda: self._cancel_asked)
            self.waiting_for, self.status = "", RUNNING
            self.result_ = self.owner.run(self, self.claim, RunDir(self.run_dir))
            self.error = self.result_.error
        except BaseException as exc:  # noqa: BLE001 - kept for .result(), raised there
            self.error = exc
            self.claim.release()
            if self.ctx is None and self._run_dir is not None:  # it never ran: the room kept for errors goes back
                RunDir(self._run_dir).release_reserves()
        finally:
            self._end()

    def _end(self) -> None:
        """The call ended: its status, its record on disk, its waiters woken, the table told."""
        self.status = self._ended_as()
        self.ended = time.time()
        if self.record is not None and self.record.begun:  # a call that never started says how it ended
            self.record.end(self.result_, self.error, number=self.number)
        self._done.set()
        self._has_run_dir.set()  # whoever waits for the run directory learns there will be none
        if self.owner is not None:
            self.owner.table.ended(self)

    def _ended_as(self) -> str:
        return CallStatus.of(self.result_, self.error)

    # -- asking ------------------------------------------------------------
    def done(self) -> bool:
        """True once the call has ended (finished, failed or cancelled)."""
        return self._done.is_set()

    def job(self, timeout: float | None = None) -> JobResult:
        """The call's JobResult (run directory, exit codes, timing), waiting up to `timeout` s for the end."""
        self._wait(timeout)
        if self.result_ is None:
            raise self.error or AirMagicError(f"call {self.short} left no result")
        return self.result_

    def result(self, timeout: float | None = None) -> list[Any]:
        """The return values by rank, waiting up to `timeout` s; raises what `.distributed` would have raised."""
        self._wait(timeout)
        if self.error is not None:
            raise self.error
        assert self.result_ is not None
        return self.result_.values

    def _wait(self, timeout: float | None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"call {self.short} ({self.spec.name}) is still {self.status} after {timeout:g} s.")

    def cancel(self) -> None:
        """Stop every rank (or stop waiting for GPUs); `.result()` then raises JobCancelledError."""
        self._cancel_asked = True
        if self.ctx is not None:
            self.ctx.cancel()

    def stop(self) -> None:
        """Ask the ranks to stop after their current step: `air_magic.should_stop()` is True on every rank from now
        on, and a loop that checks it returns normally. A call whose code never asks goes on to its end."""
        from ..stopping import request_stop

        request_stop(self.run_dir)

    def logs(self, rank: int = 0) -> str:
        """Everything rank `rank` has written so far (its log in the run directory)."""
        return RunDir(self.run_dir).log(rank).read_text(errors="replace")

    def show(self) -> None:
        """Draw this call's panel here: live while it runs, with every line written so far; its record once ended."""
        if self.owner is None:
            raise AirMagicError(
                f"call {self.short} was rebuilt from its run directory and has no owner here to draw it: "
                f"air_magic.attach({str(self.id)!r}).show() draws it."
            )
        self.owner.show(self)

    def has_run_dir(self, timeout: float | None = RUN_DIR_WAIT) -> bool:
        """Wait up to `timeout` s for the call to start in its run directory (its context, `ctx`, is then set);
        whether it has a run directory. At once while the call waits for its GPUs or slots (a background call's
        directory is made when it is spawned), and for a call that ended."""
        if self.ctx is None and self.status == WAITING and not self.done():
            return self._run_dir is not None
        self._has_run_dir.wait(timeout)
        return self._run_dir is not None or self.ctx is not None

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            if self.ctx is None and self.status == WAITING and not self.done():
                raise AirMagicError(f"call {self.short} is waiting for {self.waiting_for}: it has no run yet.")
            if not self._has_run_dir.wait(RUN_DIR_WAIT):
                raise AirMagicError(
                    f"call {self.short} ({self.spec.name}) has made no run directory in {RUN_DIR_WAIT:g} s; "
                    "its start is stuck: cancel it (`.cancel()`) and look at the helper's log in the runs directory."
                )
            self._run_dir = self.ctx.run_dir if self.ctx is not None else None
        if self._run_dir is None:
            raise AirMagicError(f"call {self.short} ended before it had a run directory: {self.error!r}")
        return self._run_dir

    @property
    def run_id(self) -> str | None:
        """The call's MLflow run id (None without MLflow, or before the run is made)."""
        for listener in self.listeners or ():
            if getattr(listener, "run_id", None):
                return str(listener.run_id)  # type: ignore[attr-defined]
        return self._record.get("run_id")

    @property
    def link(self) -> str | None:
        return (self.ctx.links.get("mlflow") if self.ctx is not None else None) or self._record.get("link")

    @property
    def alerts(self) -> list[Alert]:
        """What the watch of the call saw so far: stragglers and hangs, oldest first (docs/watching.md)."""
        if self.result_ is not None:
            return list(self.result_.alerts)
        return list(self.ctx.alerts) if self.ctx is not None else []

    def profile(self, steps: int = 5, timeout: float | None = 600) -> Profile:
        """Profile the next `steps` steps of every rank of this running call with torch.profiler, and return the
        `Profile` (also kept in `profiles`, newest last) once every rank has written its trace (docs/profiling.md).
        The owner of the call asks the ranks (its process profiles; a rebuilt handle has none)."""
        if self.owner is None:
            raise AirMagicError(
                f"call {self.short} was rebuilt from its run directory: attach to it (air_magic.attach) to profile it."
            )
        found: Profile = self.owner.profile(self, steps, timeout)
        self.profiles.append(found)
        return found

    @property
    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    def __repr__(self) -> str:
        return f"<DistributedCall {self.short} {self.spec.name}: {self.status}>"

    @classmethod
    def from_run_dir(cls, path: str | Path) -> DistributedCall:
        """The handle of an ended call, rebuilt from its run directory (after a kernel restart, say): its status,
        record, logs, exit codes and, where the ranks left them, its results or its error."""
        from .rebuilt import rebuild

        call: DistributedCall = rebuild(cls, Path(path))
        return call


def find(table: CallTable, ident: str | int | None) -> DistributedCall:
    """The call `ident` names in `table` (its number, id or a unique start of it; None: the latest background
    call); ConfigurationError listing the known calls otherwise."""
    if ident is None:
        spawned = [call for call in calls(table) if call.background]
        if spawned:
            return spawned[-1]
    found = table.find(ident)
    assert isinstance(found, DistributedCall)
    return found


def calls(table: CallTable) -> list[DistributedCall]:
    """The calls of `table`, foreground and background, oldest first."""
    return [call for call in table.all() if isinstance(call, DistributedCall)]
