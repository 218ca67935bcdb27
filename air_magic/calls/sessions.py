"""Sessions as the notebook sees them: which exist, what their ranks hold, how each ended, and the calls on them.

The state itself lives on the ranks (launch/rank/session.py), and the world that holds them in the keeper of kept
worlds (launch/keeper.py), which decides when it ends. This module writes the calling side's record of each session
on its world (`World.record`: pids, hosts, the names its ranks hold) and keeps the history of ends, so that a cell
asking for another world under a session's name is refused before anything starts, an end is never silent (said when
it is seen, and again in the `NameError` of a name the lost ranks held), and `%distributed_session` answers without
asking a busy rank. It also makes the calls that act on a session itself (push, pull, reset), through the owner's one
door like any call, and ends sessions. One `Sessions` per owner (air_magic/owner/). No IPython here (magics/).

Over 300 lines because the notebook's side of every session operation (refuse, record, push, pull, reset, end,
post-mortem) shares one record.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError, annotate
from ..job import JobResult, JobSpec
from ..launch.interface import ENDED_BY_USER
from ..launch.keeper import Keeper, World
from ..launch.rank.session import Pull, Push, Reset, SessionOp

#: The session of `--session` given without a name.
DEFAULT_SESSION = "default"
#: Seconds a session's ranks wait idle for the next cell when the cell gives no --keep-alive.
DEFAULT_IDLE = 3600.0


@dataclass
class Record:
    """One live session, as its last call left it."""

    name: str
    world_size: int
    accelerator_type: str
    num_nodes: int
    keep_alive: float
    pids: dict[int, int] = field(default_factory=dict)
    #: rank -> the address of its machine, where the launcher said (Ray).
    hosts: dict[int, str] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    #: rank -> name -> "type, size", as each rank said after its last call.
    names: dict[int, dict[str, str]] = field(default_factory=dict)

    def shape(self) -> str:
        nodes = f" on {self.num_nodes} nodes" if self.num_nodes > 1 else ""
        return f"{self.world_size} {self.accelerator_type} rank(s){nodes}"

    def held(self) -> set[str]:
        return {name for names in self.names.values() for name in names}


@dataclass
class Ended:
    """How a session ended: when, why, and what its ranks held then."""

    record: Record
    why: str
    at: float = field(default_factory=time.time)

    def line(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.at))
        return f"air_magic: session {self.record.name!r} ({self.record.shape()}) ended at {when}: {self.why}."


def check_name(name: object) -> str:
    """A session name: a non-empty string of letters, digits, '-', '_' or '.'."""
    if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name):
        raise ConfigurationError(
            f"a session name is a word such as 'default' or 'gpt2' (letters, digits, '-', '_', '.'), got {name!r}."
        )
    return name


def without_held(target: Any, held: set[str]) -> Any:
    """A notebook function whose globals leave out the names the session holds: the rank's own win there anyway,
    so a large notebook object of the same name is not serialized for nothing."""
    if not held or not inspect.isfunction(target) or target.__module__ != "__main__":
        return target
    if not held & set(target.__code__.co_names):
        return target
    kept = {name: value for name, value in target.__globals__.items() if name not in held}
    copy = types.FunctionType(target.__code__, kept, target.__name__, target.__defaults__, target.__closure__)
    copy.__kwdefaults__ = target.__kwdefaults__
    copy.__dict__.update(target.__dict__)
    copy.__qualname__ = target.__qualname__
    copy.__module__ = target.__module__
    return copy


def check_ranks(ranks: object, session: str | None) -> tuple[int, ...]:
    """Rank numbers of a session call (`ranks=` or `--ranks`), sorted and once each; checked here for both doors."""
    if (
        isinstance(ranks, (str, bytes))
        or not isinstance(ranks, (tuple, list, set, frozenset))
        or not ranks
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
    ):
        raise ConfigurationError(f"ranks must be rank numbers such as (0,) or 0,2, got {ranks!r}.")
    if session is None:
        raise ConfigurationError(
            "ranks=/--ranks runs a call on some ranks of a session, and no session is named: "
            "add session='NAME' (or --session [NAME] to %%distributed)."
        )
    return tuple(sorted(set(ranks)))


def with_session(spec: JobSpec, name: str | None, ranks: tuple[int, ...] | None) -> JobSpec:
    """`spec` as a call of session `name` (its idle time defaulting to DEFAULT_IDLE); `name` and `ranks` come
    checked from the front door's Settings."""
    if name is None:
        return spec
    return dataclasses.replace(spec, session=name, ranks=ranks, keep_alive=spec.keep_alive or DEFAULT_IDLE)


class Sessions:
    """The sessions of one owner (air_magic/owner/): which are live (their worlds, in its keeper), the history of
    ends, and the calls that act on a session, made through the owner's one door."""

    def __init__(self, owner: Any) -> None:
        #: The owner of calls of this process (air_magic.owner.Owner): its keeper, launchers and door.
        self.owner = owner
        self.keeper: Keeper = owner.keeper
        #: The last end of each session, by name, with what its ranks held then (said again in a NameError).
        self.ended: dict[str, Ended] = {}

    def _record_of(self, name: str) -> Record | None:
        """The record of session `name`, which rides on its kept world (launch/keeper.py): None if no world of that
        name is kept, or its first call has not finished."""
        world = self.keeper.session(name, World)
        return world.record if world is not None else None

    def _finish(self, record: Record, why: str, at: float | None = None) -> Ended:
        """Session `record` ended for `why` (at `at`, wall clock; now if not known): kept in the history of ends.
        Its GPUs and CPU slots went back when the keeper let its world go (the owner's ledger)."""
        ended = self.ended[record.name] = Ended(record, why, at if at is not None else time.time())
        return ended

    def _ends(self) -> list[tuple[World, Ended]]:
        """Each session's world that ended outside a call (idle, released, lost) since the last look, now in the
        history of ends; a world that never finished a call has no record, and nothing to say."""
        return [
            (world, self._finish(world.record, why, world.ended_at))
            for world, why in self.keeper.ended_sessions()
            if world.record is not None
        ]

    def _notice_ends(self, quiet: World | None = None) -> list[Ended]:
        """Say each session that ended outside a call since the last look, once; the end of `quiet`'s world is
        returned instead of said."""
        own = []
        for world, ended in self._ends():
            if world is quiet:
                own.append(ended)
            else:
                print(ended.line(), file=sys.stderr)
        return own

    def live(self) -> dict[str, Record]:
        """The sessions alive now, by name: the kept worlds of sessions that finished a call (ends noticed since the
        last look are said first)."""
        self._notice_ends()
        return {
            w.session: w.record for w in self.keeper.worlds(World) if w.session is not None and w.record is not None
        }

    def held_names(self, name: str | None) -> set[str]:
        """The names session `name`'s ranks assigned, as last reported: notebook globals of those names stay here."""
        record = self._record_of(name or "")
        return record.held() if record is not None else set()

    def before(self, spec: JobSpec) -> Record | None:
        """Refuse a call that asks for another world under a live session's name, before anything starts; the
        session's record as the call finds it (None: the call starts it)."""
        self._notice_ends()
        record = self._record_of(spec.session or "")
        if record is None:
            if spec.ranks is not None and max(spec.ranks) >= spec.world_size:
                raise ConfigurationError(
                    f"--ranks {','.join(map(str, spec.ranks))}: session {spec.session!r} would have ranks "
                    f"0-{spec.world_size - 1}; name ranks of the session."
                )
            return None
        asked = Record(spec.session or "", spec.world_size, spec.accelerator_type, spec.num_nodes, 0.0)
        if asked.shape() != record.shape():
            raise ConfigurationError(
                f"session {record.name!r} runs {record.shape()}, and this call asks for {asked.shape()}. "
                f"Leave out the options that change the world, use another session name, or end this one first: "
                f"%distributed_session --end {record.name} (what its ranks hold is lost)."
            )
        if spec.ranks is not None and max(spec.ranks) >= record.world_size:
            raise ConfigurationError(
                f"--ranks {','.join(map(str, spec.ranks))}: session {record.name!r} has ranks "
                f"0-{record.world_size - 1}."
            )
        return record

    def after(self, spec: JobSpec, result: JobResult, found: Record | None = None) -> None:
        """Record what the call left on the session's kept world: its pids and names, or its end (kept in the history
        of ends), and explain a NameError for a name that ranks of an ended session held. `found`: the session's record
        when the call came (`before`)."""
        # ranks found lost when this call came (Ray) ended with their reason before it started new ones
        self._notice_ends()
        name = spec.session or ""
        world = self.keeper.session(name, World)
        record = world.record if world is not None else None
        pids = {r.rank: r.pid for r in result.ranks if r.pid is not None}
        if (
            result.session_end is None
            and record is not None
            and pids
            and set(pids.values()) != set(record.pids.values())
        ):
            self._finish(
                record, "its ranks were gone when the next call came (the helper or the kernel's processes ended)"
            )
            record = None
        before_restart = record or found  # the world before a restart is gone, with what its ranks held
        if result.session_restarted is not None and before_restart is not None:
            self._finish(before_restart, result.session_restarted)
            record = None
        if result.session_end is not None:  # said to the call already; kept in the history with what its ranks held
            ended = record or found
            noticed = self.ended.get(name)
            if ended is None and (noticed is None or noticed.why != result.session_end):
                ended = Record(name, spec.world_size, spec.accelerator_type, spec.num_nodes, spec.keep_alive or 0.0)
            if ended is not None:  # an end noticed already keeps the names its ranks held
                self._finish(ended, result.session_end)
            if world is not None:  # still being ended: not live, and its end is not said again
                world.record = None
            record = None
        # A call that restarted (max_restarts) ran its last attempt in new ranks, which the launcher keeps as the
        # session unless that attempt ended them: they are its world from now on.
        if world is not None and pids and result.session_end is None:
            if record is None:
                record = Record(
                    name, spec.world_size, spec.accelerator_type, spec.num_nodes, spec.keep_alive or DEFAULT_IDLE, pids
                )
            record.pids, record.last_used = pids, time.monotonic()
            record.hosts = {r.rank: r.host for r in result.ranks if r.host}
            record.keep_alive = spec.keep_alive or record.keep_alive
            record.names.update(result.session_names)
            world.record = record
        self._explain_name_error(name, result.error)

    def _explain_name_error(self, name: str, error: BaseException | None) -> None:
        ended = self.ended.get(name)
        if ended is None or not isinstance(error, NameError):
            return
        found = re.search(r"name '(\w+)' is not defined", str(error))
        if found and found.group(1) in ended.record.held():
            holders = sorted(r for r, names in ended.record.names.items() if found.group(1) in names)
            annotate(
                error,
                f"{ended.line()} Rank(s) {', '.join(map(str, holders))} held {found.group(1)!r} then; "
                "this session's ranks are new and start empty.",
            )

    def _record(self, name: str) -> Record:
        record = self.live().get(name)
        if record is None:
            ended = self.ended.get(name)
            why = f" ({ended.line()})" if ended is not None else ""
            raise ConfigurationError(
                f"there is no live session {name!r}{why}; start it with a `%%distributed --session {name}` cell, or "
                "`@distributed(session=...)`."
            )
        return record

    def _on_session(self, name: str, op: SessionOp, ranks: tuple[int, ...] | None, what: str) -> JobResult:
        record = self._record(name)
        spec = JobSpec(
            target=op,
            args=(),
            kwargs={},
            name=f"{what} (session {name})",
            world_size=record.world_size,
            accelerator_type=record.accelerator_type,
            timeout=None,
            mlflow=False,
            keep_alive=record.keep_alive,
            num_nodes=record.num_nodes,
            session=name,
            ranks=ranks,
        )
        result = self.owner.submit(spec, listeners=[], recorded=False)
        return result.raise_for_status()

    def push(self, name: str, values: dict[str, Any], ranks: tuple[int, ...] | None = None) -> None:
        """Send notebook values into session `name` (every rank, or `ranks`), under the same names."""
        self._on_session(
            name, Push(values), None if ranks is None else check_ranks(ranks, name), "push " + ", ".join(sorted(values))
        )

    def pull(self, name: str, variable: str, rank: int | None = None) -> Any:
        """The value of `variable` on every rank of session `name` (a list by rank), or on `rank` alone."""
        result = self._on_session(name, Pull(variable), None if rank is None else (rank,), f"pull {variable}")
        return result.values[0] if rank is not None else result.values

    def reset(self, name: str) -> None:
        """Empty session `name`'s namespaces; its processes, process group and imports stay."""
        self._on_session(name, Reset(), None, "reset")
        self._record(name).names.clear()

    def end(self, name: str) -> str:
        """End session `name`'s ranks now; the line that says so."""
        record = self._record(name)
        world = self.keeper.session(name, World)
        self.owner.launchers.for_nodes(record.num_nodes).end_session(name, ENDED_BY_USER)
        own = self._notice_ends(quiet=world)  # an idle world's end, said here rather than at the next look
        return (own[0] if own else self._finish(record, ENDED_BY_USER)).line()

    def released(self) -> list[str]:
        """After %distributed_release: the sessions it ended; a line for each (said here, not again at the next
        look)."""
        return [ended.line() for _, ended in self._ends()]

    def post_mortem(self, session: str, rank: int | None = None) -> None:
        """Open the debugger on the error that `rank` of `session` keeps (default: the rank that raised first)."""
        from ..launch.rank.debugger import LastError, PostMortem
        from .debugging import NOT_IN_SESSION

        alive = self.live()
        if session not in alive:
            raise ConfigurationError(NOT_IN_SESSION.format(why=f"there is no live session {session!r}"))
        kept = self._on_session(session, LastError(), None, "debug: which ranks keep an error").values
        errors = {r: e for r, e in enumerate(kept) if e is not None}
        if not errors:
            raise ConfigurationError(
                NOT_IN_SESSION.format(
                    why=f"no rank of session {session!r} keeps an error "
                    "(its last cell raised none, or a cell ran since)"
                )
            )
        if rank is None:
            rank = min(errors, key=lambda r: (errors[r][2], r))
        elif rank not in errors:
            have = ", ".join(f"rank {r} ({e[0]})" for r, e in sorted(errors.items()))
            raise ConfigurationError(f"rank {rank} of session {session!r} keeps no error; {have} do.")
        self._on_session(session, PostMortem(), (rank,), f"post-mortem of rank {rank}")
