"""The calling side's record of a session rides on its kept world: a session is live exactly while the keeper keeps
its world, and each end (idle, lost, restarted, ended in a call) is kept in the history with what its ranks held.
No process: the worlds are the keeper's own records, ended by its rules."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from air_magic.calls.ledger import CPU, Ledger
from air_magic.calls.sessions import Sessions
from air_magic.job import JobResult, JobSpec, RankResult, RankState
from air_magic.launch.keeper import RELEASED, World
from air_magic.owner import Owner

#: The sessions of the test's owner (set by the `keeper` fixture).
sessions: Sessions


@pytest.fixture
def keeper():
    """An owner of its own (a ledger of 4 CPU slots, not leased machine-wide): its keeper, and its sessions as
    `sessions`."""
    global sessions
    own = Owner(ledger=Ledger([], 4))
    sessions = own.sessions
    yield own.keeper
    own.keeper.end_all("test over", say=False)


def spec(name: str = "s", world_size: int = 2) -> JobSpec:
    return JobSpec(
        target=print,
        args=(),
        kwargs={},
        name="f",
        world_size=world_size,
        accelerator_type="CPU",
        timeout=None,
        keep_alive=60.0,
        session=name,
    )


def result(call: JobSpec, pids: tuple[int, ...], **fields) -> JobResult:
    ranks = [RankResult(rank, RankState.DONE, pid=pid) for rank, pid in enumerate(pids)]
    return JobResult(call, Path("."), ranks, **fields)


def session_call(k, call: JobSpec, pids: tuple[int, ...], world: World | None = None, **fields) -> World:
    """One call of the session as a launcher runs it: take (or start) its world, run, leave it idle, record."""
    found = sessions.before(call)
    world = world or k.take("key", str(call.world_size), "c", session=call.session)
    if world is None:
        world = World("key", str(call.world_size), 60.0, session=call.session, call="c")
        k.add(world)
    res = result(call, pids, **fields)
    if res.session_end is None:
        k.done(world)
    sessions.after(call, res, found)
    return world


def test_a_session_lives_while_its_world_is_kept_and_its_end_is_said_once_with_what_it_held(keeper, capsys):
    call = spec()
    world = session_call(keeper, call, (11, 12), session_names={0: {"model": "Linear, 1 KiB"}})
    assert list(sessions.live()) == ["s"] and sessions.live()["s"].pids == {0: 11, 1: 12}
    assert world.record is sessions.live()["s"], "the record rides on the keeper's world"
    assert sessions.held_names("s") == {"model"}

    keeper.release(world, "idle for 60 s (its keep-alive)")
    assert sessions.live() == {}
    said = capsys.readouterr().err
    assert "session 's' (2 CPU rank(s)) ended at" in said and "idle for 60 s" in said
    assert sessions.live() == {} and capsys.readouterr().err == "", "said once"
    assert sessions.held_names("s") == set()

    error = NameError("name 'model' is not defined")
    session_call(keeper, call, (21, 22), error=error)
    assert "Rank(s) 0 held 'model' then" in "".join(getattr(error, "__notes__", []))
    assert sessions.live()["s"].pids == {0: 21, 1: 22}


def test_new_ranks_under_the_same_world_end_the_old_record(keeper):
    """The helper was replaced between calls: the same kept world, new pids; what the old ranks held is gone."""
    call = spec()
    world = session_call(keeper, call, (11, 12), session_names={1: {"x": "int"}})
    session_call(keeper, call, (31, 32), world=keeper.take("key", "2", "c2", session="s"))
    assert sessions.live()["s"].pids == {0: 31, 1: 32} and sessions.held_names("s") == set()
    assert sessions.ended["s"].why.startswith("its ranks were gone") and sessions.ended["s"].record.held() == {"x"}
    assert world.record is sessions.live()["s"]


def test_a_restart_keeps_the_old_worlds_names_in_the_history_and_the_new_world_as_the_session(keeper, capsys):
    call = spec()
    old = session_call(keeper, call, (11, 12), session_names={0: {"opt": "SGD"}})
    found = sessions.before(call)
    assert keeper.take("key", "2", "c2", session="s") is old
    keeper.release(old, "a restart (max_restarts) started its ranks again after: rank 1 died")  # said to the call
    new = World("key", "2", 60.0, session="s", call="c2")
    keeper.add(new)
    keeper.done(new)
    sessions.after(call, result(call, (41, 42), session_restarted="a restart (max_restarts) ..."), found)
    assert sessions.live()["s"] is new.record and new.record.pids == {0: 41, 1: 42}
    assert sessions.ended["s"].record.held() == {"opt"}
    assert capsys.readouterr().err == "", "a busy world's end is said to its call, not again"


def test_an_end_during_a_call_is_in_the_history_and_the_session_is_gone(keeper):
    call = spec()
    world = session_call(keeper, call, (11, 12), session_names={0: {"w": "Tensor"}})
    found = sessions.before(call)
    keeper.take("key", "2", "c2", session="s")
    keeper.release(world, "rank 1 raised an error that leaves it unusable")
    sessions.after(call, result(call, (11, 12), session_end="rank 1 raised an error that leaves it unusable"), found)
    assert sessions.live() == {}
    assert sessions.ended["s"].record.held() == {"w"} and "unusable" in sessions.ended["s"].why


def test_a_world_that_never_finished_a_call_ends_without_a_word_and_release_says_each_session_once(keeper, capsys):
    keeper.add(World("key", "2", 60.0, session="never"))
    session_call(keeper, spec("a"), (1, 2))
    session_call(keeper, spec("b", 1), (3,))
    keeper.release_idle(RELEASED)
    lines = sessions.released()
    assert len(lines) == 2 and all(RELEASED in line for line in lines)
    assert {"'a'", "'b'"} == {line.split()[2] for line in lines}
    assert sessions.live() == {} and capsys.readouterr().err == ""


def test_a_call_asking_another_shape_under_a_live_name_is_refused_before_anything_starts(keeper):
    session_call(keeper, spec(), (1, 2))
    with pytest.raises(Exception, match=r"session 's' runs 2 CPU rank\(s\), and this call asks for 4 CPU rank\(s\)"):
        sessions.before(spec(world_size=4))


def test_a_sessions_units_are_held_by_its_world_and_freed_the_moment_it_ends(keeper):
    """The units a session's first call took are the world's once the call leaves it kept; a restart's new world
    keeps its own; each world's end frees its units at once, with no later look."""
    own_ledger = sessions.owner.ledger
    call = spec()
    assert own_ledger.take("call c1", 2, CPU, "call c1 (f)") == ("0", "1")
    old = session_call(keeper, call, (11, 12))
    assert own_ledger.hand_over("call c1", old, "session 's'") and own_ledger.free(CPU) == ["2", "3"]
    found = sessions.before(call)
    keeper.take("key", "2", "c2", session="s")
    assert own_ledger.take("call c2", 2, CPU, "call c2 (f)") == ("2", "3")
    keeper.release(old, "a restart")
    assert own_ledger.free(CPU) == ["0", "1"], "the old world's units went back as it ended"
    new = World("key", "2", 60.0, session="s", call="c2")
    keeper.add(new)
    keeper.done(new)
    assert own_ledger.hand_over("call c2", new, "session 's'")
    sessions.after(call, result(call, (41, 42), session_restarted="a restart"), found)
    assert own_ledger.holders()[new].units == ("2", "3")
    keeper.release(new, "idle for 60 s (its keep-alive)")
    assert own_ledger.free(CPU) == ["0", "1", "2", "3"]


def test_an_idle_sessions_end_is_said_with_the_time_it_ended_not_the_time_it_was_seen(keeper):
    """A session whose world ended idle says, at the next look, the clock time of its end."""
    world = session_call(keeper, spec(), (11, 12))
    keeper.release(world, "idle for 60 s (its keep-alive)")
    assert world.ended_at is not None
    world.ended_at -= 3600  # seen an hour later
    sessions.live()
    ended = sessions.ended["s"]
    assert ended.at == world.ended_at
    assert time.strftime("%H:%M:%S", time.localtime(world.ended_at)) in ended.line()


def test_an_end_said_to_its_call_while_the_world_is_still_being_ended_is_not_said_again(keeper, capsys):
    """A launcher that ends the world after the call's result came back: the session is not live from the result
    on, and the keeper's later end of that world says nothing more."""
    call = spec()
    world = session_call(keeper, call, (11, 12), session_names={0: {"w": "Tensor"}})
    found = sessions.before(call)
    keeper.take("key", "2", "c2", session="s")
    sessions.after(call, result(call, (11, 12), session_end="rank 0 did not come back"), found)
    assert sessions.live() == {} and sessions.ended["s"].record.held() == {"w"}
    keeper.done(world)
    keeper.release(world, "its ranks were stopped")
    assert sessions.live() == {} and capsys.readouterr().err == ""
    assert "did not come back" in sessions.ended["s"].why
