"""The keeper of kept worlds as a plain object: who takes a world, what ends one and why, and the helper's pools."""

from __future__ import annotations

import os

import pytest

from air_magic.launch.keeper import Keeper, SessionBusy, World
from air_magic.launch.local.pool import Pool, Pools


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def kept():
    """A keeper whose ends and session notices are recorded."""
    ended: list[World] = []
    said: list[tuple[str | None, str]] = []
    clock = Clock()
    keeper: Keeper[World] = Keeper(ended.extend, lambda w, why: said.append((w.session, why)), clock)
    return keeper, ended, said, clock


def idle(keeper: Keeper[World], key: str = "k", shape: str = "2", keep_alive: float = 60.0, **kw) -> World:
    world = World(key, shape, keep_alive, **kw)
    keeper.add(world)
    return world


def test_a_plain_call_takes_an_idle_hot_world_of_its_key_and_shape_only(kept):
    """Same key and shape: the idle world, now busy with the call; never a session's, a spare or a busy one."""
    keeper, ended, _, _ = kept
    good = idle(keeper)
    idle(keeper, session="s")
    idle(keeper, spare=True)
    assert keeper.take("k", "3", "c1") is None and keeper.take("other", "2", "c1") is None
    assert keeper.take("k", "2", "c1") is good and good.busy and good.call == "c1"
    assert keeper.take("k", "2", "c2") is None, "a busy world is not taken twice"
    assert ended == []


def test_a_session_call_takes_its_sessions_world_whatever_its_key_or_is_told_why_not(kept):
    """A session's world is found by name; busy or of another shape, the call is refused, saying how to end it."""
    keeper, _, _, _ = kept
    world = idle(keeper, key="env-a", session="s")
    assert keeper.take("env-b", "2", "c1", session="s") is world
    with pytest.raises(SessionBusy, match=r"session 's' holds 2 rank\(s\) and is running a call; end it with"):
        keeper.take("env-b", "2", "c2", session="s")
    keeper.done(world)
    with pytest.raises(SessionBusy, match="%distributed_session --end s") as refused:
        keeper.take("env-b", "4", "c3", session="s")
    assert "running a call" not in str(refused.value)
    assert keeper.take("k", "2", "c4", session="other") is None, "an unknown session starts its world"


def test_an_idle_world_ends_after_its_keep_alive_and_a_session_end_is_said_once(kept):
    """Idle `keep_alive` s ends a world; a busy or younger one stays; a session's end is said with its reason."""
    keeper, ended, said, clock = kept
    old = idle(keeper, keep_alive=10, session="s")
    young = idle(keeper, keep_alive=1000)
    busy = idle(keeper, keep_alive=10)
    keeper.take("k", "2", "c")  # takes `young` or `busy`: make it `busy` explicitly
    for w in (young, busy):
        w.call = ""
    busy.call = "c"
    clock.now += 10
    assert keeper.expire() == [old]
    assert ended == [old] and said == [("s", "idle for 10 s (its keep-alive)")]
    assert keeper.worlds() == [young, busy]


def test_a_timers_end_does_nothing_once_a_call_took_the_world(kept):
    """expire_one ends a world only if no call took it since the timer was armed."""
    keeper, ended, _, _ = kept
    world = idle(keeper)
    generation = keeper.done(world)
    keeper.take("k", "2", "c")
    keeper.done(world)
    assert not keeper.expire_one(world, generation) and ended == []
    assert keeper.expire_one(world, world.generation) and ended == [world]


def test_release_idle_can_spare_sessions_and_end_all_ends_running_worlds(kept):
    """A call waiting for resources ends plain idle worlds only; the kernel's end ends every world."""
    keeper, ended, said, _ = kept
    plain, session, running = idle(keeper), idle(keeper, session="s"), idle(keeper, key="r")
    keeper.take("r", "2", "c")
    assert keeper.release_idle("needed", sessions=False) == [plain]
    assert keeper.release_idle("released") == [session] and said == [("s", "released")]
    keeper.end_all("the kernel shut down", say=False)
    assert ended == [plain, session, running] and keeper.worlds() == [] and len(said) == 1


def test_a_spare_is_taken_only_by_its_key_and_once(kept):
    """take_spare hands the spare set over (no longer kept); a plain call never takes it as a hot world."""
    keeper, _, _, _ = kept
    spare = idle(keeper, key="spare/2x2", spare=True)
    assert keeper.take("spare/2x2", "2", "c") is None
    assert keeper.take_spare("spare/1x2") is None
    assert keeper.take_spare("spare/2x2") is spare and keeper.take_spare("spare/2x2") is None


def test_what_a_call_leaves():
    """A clean call keeps its world; a failed one keeps only a session's whose ranks stayed usable."""
    plain, session = World("k", "2", 1.0), World("k", "2", 1.0, session="s")
    assert Keeper.keeps(plain, clean=True, usable=True)
    assert not Keeper.keeps(plain, clean=False, usable=True)
    assert Keeper.keeps(session, clean=False, usable=True)
    assert not Keeper.keeps(session, clean=False, usable=False)
    assert not Keeper.keeps(None, clean=True, usable=True)


def test_what_kept_worlds_hold_is_counted_for_the_ledger(kept):
    """holds() lists every device or slot kept worlds hold, busy or idle."""
    keeper, _, _, _ = kept
    idle(keeper, holds=(("gpu", 0), ("gpu", 1)))
    idle(keeper, key="c", holds=(("cpu", 0),))
    assert sorted(keeper.holds()) == [("cpu", 0), ("gpu", 0), ("gpu", 1)]


def test_done_lines_are_read_across_chunks():
    """A rank's "<code>" lines may arrive split or together; each finished line is one exit code (and whether the
    rank stays usable)."""
    pool = Pool("k", "2", 60.0)
    assert pool.feed(0, b"0") == []
    assert pool.feed(0, b"\n1\n") == [(0, True), (1, False)]
    assert pool.feed(1, b"\n") == [(1, False)], "an empty line counts as a failure"


def test_releasing_a_pool_closes_its_pipes_and_tells_of_a_sessions_end():
    """Ending a pool closes its command and done pipes, which is how its ranks learn to exit."""
    told: list[tuple[str | None, str]] = []
    pools = Pools(on_session_end=lambda pool, why: told.append((pool.session, why)))
    pool = Pool("k", "2", 60.0, session="s")
    cmd_r, cmd_w = os.pipe()
    done_r, done_w = os.pipe()
    pool.cmd[0], pool.done[0] = cmd_w, done_r
    pools.add(pool)
    assert pools.done_fds() == {done_r: (pool, 0)} and sorted(pools.fds()) == sorted([cmd_w, done_r])
    try:
        assert pools.release(pool, "ended")
        assert pools.pools == [] and pools.fds() == [] and told == [("s", "ended")]
        assert os.read(cmd_r, 1) == b"", "end-of-file on the command pipe"
        with pytest.raises(OSError):
            os.fstat(done_r)
        assert not pools.release(pool, "again"), "twice is harmless"
        pools.tick()
        assert not pools.releasing, "a released pool with no process left is forgotten"
    finally:
        os.close(cmd_r)
        os.close(done_w)


def test_a_pool_is_found_by_its_workers_and_store():
    """holding() finds the pools a pid is a worker of; store_pids() the stores kept pools hold."""
    pools = Pools()
    pool = Pool("k", "2", 60.0)
    pool.pids[0], pool.store_pid = 11, 12
    pools.add(pool)
    assert pools.holding(11) == [pool] and pools.holding(99) == [] and pools.store_pids() == {12}
