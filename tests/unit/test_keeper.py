"""The keeper of kept worlds as a plain object: who takes a world, what ends one and why; the helper's plain table of
pools; and the local launcher's decisions on the caller's side (launch/local/worlds.py), without processes."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import pytest

from air_magic.launch import protocol as p
from air_magic.launch.keeper import Keeper, SessionBusy, World
from air_magic.launch.local import worlds
from air_magic.launch.local.pool import Pool, Pools
from air_magic.launch.local.worlds import CallWorld, LocalWorld


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class Recorded(World):
    """A world whose end and whose session sentence said to its call are recorded."""

    ends: list[World] = field(default_factory=list, repr=False)
    told: list[str] = field(default_factory=list, repr=False)

    def end(self, why: str) -> None:
        self.ends.append(self)

    def said(self, why: str) -> None:
        self.told.append(why)


@pytest.fixture
def kept_():
    """A keeper without timers, on a clock of its own, whose ends are recorded; the third item reads
    ended_sessions as (session, why)."""
    ended: list[World] = []
    clock = Clock()
    keeper = Keeper(clock, timers=False)
    keeper.ended_list = ended  # type: ignore[attr-defined]
    return keeper, ended, lambda: named(keeper), clock


def named(keeper: Keeper) -> list[tuple[str | None, str]]:
    return [(world.session, why) for world, why in keeper.ended_sessions()]


def idle(keeper: Keeper, key: str = "k", shape: str = "2", keep_alive: float = 60.0, **kw) -> World:
    world = Recorded(key, shape, keep_alive, ends=keeper.ended_list, **kw)  # type: ignore[attr-defined]
    keeper.add(world)
    return world


def test_a_plain_call_takes_an_idle_hot_world_of_its_key_and_shape_only(kept_):
    """Same key and shape: the idle world, now busy with the call; never a session's, a spare or a busy one."""
    keeper, ended, _, _ = kept_
    good = idle(keeper)
    idle(keeper, session="s")
    idle(keeper, spare=True)
    assert keeper.take("k", "3", "c1") is None and keeper.take("other", "2", "c1") is None
    assert keeper.take("k", "2", "c1") is good and good.busy and good.call == "c1"
    assert keeper.take("k", "2", "c2") is None, "a busy world is not taken twice"
    assert ended == []


def test_a_session_call_takes_its_sessions_world_whatever_its_key_or_is_told_why_not(kept_):
    """A session's world is found by name; busy or of another shape, the call is refused, saying how to end it."""
    keeper, _, _, _ = kept_
    world = idle(keeper, key="env-a", session="s")
    assert keeper.take("env-b", "2", "c1", session="s") is world
    with pytest.raises(SessionBusy, match=r"session 's' holds 2 rank\(s\) and is running a call; end it with"):
        keeper.take("env-b", "2", "c2", session="s")
    keeper.done(world)
    with pytest.raises(SessionBusy, match="%distributed_session --end s") as refused:
        keeper.take("env-b", "4", "c3", session="s")
    assert "running a call" not in str(refused.value)
    assert keeper.take("k", "2", "c4", session="other") is None, "an unknown session starts its world"


def test_an_idle_world_ends_after_its_keep_alive_and_a_session_end_is_said_once(kept_):
    """Idle `keep_alive` s ends a world; a busy or younger one stays; a session's end is said with its reason."""
    keeper, ended, ended_sessions, clock = kept_
    old = idle(keeper, keep_alive=10, session="s")
    young = idle(keeper, keep_alive=1000)
    busy = idle(keeper, keep_alive=10)
    keeper.take("k", "2", "c")  # takes `young` or `busy`: make it `busy` explicitly
    for w in (young, busy):
        w.call = ""
    busy.call = "c"
    clock.now += 10
    assert keeper.expire() == [old]
    assert ended == [old] and ended_sessions() == [("s", "idle for 10 s (its keep-alive)")]
    assert ended_sessions() == [], "said once"
    assert keeper.worlds() == [young, busy]


def test_a_timers_end_does_nothing_once_a_call_took_the_world(kept_):
    """expire_one ends a world only if no call took it since the timer was armed."""
    keeper, ended, _, _ = kept_
    world = idle(keeper)
    generation = keeper.done(world)
    keeper.take("k", "2", "c")
    keeper.done(world)
    assert not keeper.expire_one(world, generation) and ended == []
    assert keeper.expire_one(world, world.generation) and ended == [world]


def test_release_idle_can_spare_sessions_and_end_all_ends_running_worlds(kept_):
    """A call waiting for resources ends plain idle worlds only; the kernel's end ends every world."""
    keeper, ended, ended_sessions, _ = kept_
    plain, session, running = idle(keeper), idle(keeper, session="s"), idle(keeper, key="r")
    keeper.take("r", "2", "c")
    assert keeper.release_idle("needed", sessions=False) == [plain]
    assert keeper.release_idle("released") == [session] and ended_sessions() == [("s", "released")]
    keeper.end_all("the kernel shut down", say=False)
    assert ended == [plain, session, running] and keeper.worlds() == [] and ended_sessions() == []


def test_a_spare_is_taken_only_by_its_key_and_once(kept_):
    """take_spare hands the spare set over (no longer kept); a plain call never takes it as a hot world."""
    keeper, _, _, _ = kept_
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


def test_a_busy_sessions_end_is_said_to_its_call_and_an_idle_ones_in_ended_sessions(kept_):
    """A session's world ended while a call runs in it tells that call; idle, the record of ends outside a call."""
    keeper, _, ended_sessions, _ = kept_
    running = idle(keeper, session="busy")
    keeper.take("k", "2", "c", session="busy")
    idle(keeper, session="idle")
    keeper.release_idle("released")
    keeper.release(running, "ended by hand")
    assert ended_sessions() == [("idle", "released")]
    assert running.told == ["ended by hand"]  # type: ignore[attr-defined]
    lost = World("k", "2", 1.0, session="lost")
    keeper.session_ended(lost, "its world was lost")
    assert keeper.ended_sessions() == [(lost, "its world was lost")], "the world itself, with what rides on it"


def test_an_idle_worlds_timer_ends_it_unless_a_call_takes_it_first():
    """done() arms one timer per idle world: it ends the world after keep_alive s; a call that takes it disarms it."""
    keeper = Keeper()
    ended = threading.Event()
    world = Recorded("k", "2", 0.05)
    world.end = lambda why: ended.set()  # type: ignore[method-assign]
    keeper.add(world)
    keeper.take("k", "2", "c")
    keeper.done(world)
    assert world.timer is not None
    keeper.take("k", "2", "c2")
    assert world.timer is None, "a taken world's timer is cancelled"
    keeper.done(world)
    assert ended.wait(30) and keeper.worlds() == []
    assert keeper.ended_sessions() == []


def test_worlds_of_one_kind_are_taken_only_by_their_launcher(kept_):
    """One keeper holds both launchers' worlds: a call takes only a world of its launcher's kind."""
    keeper, _, _, _ = kept_
    idle(keeper, session="s")
    assert keeper.take("k", "2", "c", session="s", kind=LocalWorld) is None
    assert keeper.session("s", LocalWorld) is None and keeper.session("s") is not None


def test_the_keeper_tells_its_owner_of_every_end_at_once_with_the_time_it_ended():
    """Each way a world ends (released, dropped by its call, taken as a spare, expired) is told to `on_end` before
    the keeper's method returns, with the wall-clock time of the end on the world."""
    told: list[World] = []
    clock = Clock()
    keeper = Keeper(clock, timers=False, on_end=told.append)
    released, dropped, spare, expired = (World(f"k{i}", "2", 10.0) for i in range(4))
    spare.spare = True
    for world in (released, dropped, spare, expired):
        keeper.add(world)
    keeper.release(released, "asked")
    keeper.drop(dropped)
    assert keeper.take_spare("k2") is spare
    clock.now += 11
    assert keeper.expire() == [expired]
    assert told == [released, dropped, spare, expired]
    assert all(w.ended_at is not None for w in (released, dropped, expired)), "a spare is taken, not ended"


def test_a_call_hands_its_units_only_to_a_world_still_kept():
    """`left_by` reaches the worlds kept now whose last call was that call, not one ended meanwhile."""
    keeper = Keeper(timers=False)
    kept_world, ended_world = World("k", "2", 10.0, call_id="c1"), World("j", "2", 10.0, call_id="c1")
    keeper.add(kept_world)
    keeper.add(ended_world)
    keeper.release(ended_world, "lost")
    handed: list[World] = []
    assert keeper.left_by("c1", lambda w: handed.append(w) is None) is True
    assert handed == [kept_world]
    assert keeper.left_by("c2", lambda w: True) is False


def test_done_lines_are_read_across_chunks():
    """A rank's "<code>" lines may arrive split or together; each finished line is one exit code (and whether the
    rank stays usable); "took" says a session call's SIGINT reaches the rank from now on."""
    pool = Pool("p", 2)
    assert pool.feed(0, b"0") == (False, [])
    assert pool.feed(0, b"\n1\n") == (False, [(0, True), (1, False)])
    assert pool.feed(1, b"\n") == (False, [(1, False)]), "an empty line counts as a failure"
    assert pool.feed(1, b"1 kept\n") == (False, [(1, True)]), "a session's rank that raised in user code stays usable"
    assert pool.feed(1, b"to") == (False, [])
    assert pool.feed(1, b"ok\n1 ke") == (True, [])
    assert pool.feed(1, b"pt\n") == (False, [(1, True)])


def test_ending_a_pool_closes_its_pipes_once():
    """Ending a pool closes its command and done pipes, which is how its ranks learn to exit."""
    pools = Pools()
    pool = Pool("p", 2, session="s")
    cmd_r, cmd_w = os.pipe()
    done_r, done_w = os.pipe()
    pool.cmd[0], pool.done[0] = cmd_w, done_r
    pools.add(pool)
    assert pools.get("p") is pool and pools.get(None) is None
    assert pools.done_fds() == {done_r: (pool, 0)} and sorted(pools.fds()) == sorted([cmd_w, done_r])
    try:
        assert pools.end(pool)
        assert pools.pools == [] and pools.fds() == [] and pools.get("p") is None
        assert os.read(cmd_r, 1) == b"", "end-of-file on the command pipe"
        with pytest.raises(OSError):
            os.fstat(done_r)
        assert not pools.end(pool), "twice is harmless"
        pools.tick()
        assert not pools.releasing, "an ended pool with no process left is forgotten"
    finally:
        os.close(cmd_r)
        os.close(done_w)


def test_a_pool_is_found_by_its_workers_and_store():
    """holding() finds the pools a pid is a worker of; store_pids() the stores kept pools hold."""
    pools = Pools()
    pool = Pool("p", 2)
    pool.pids[0], pool.store_pid = 11, 12
    pools.add(pool)
    assert pools.holding(11) == [pool] and pools.holding(99) == [] and pools.store_pids() == {12}


# -- the local launcher's decisions, on the caller's side ------------------------------------------------------------
class Client:
    """A helper client that records what it is asked."""

    alive = True

    def __init__(self) -> None:
        self.sent: list[p.Message] = []

    def send(self, message: p.Message) -> None:
        self.sent.append(message)


def request(job: str = "j1", session: str | None = None, keep_alive: float | None = 60.0) -> p.JobRequest:
    return p.JobRequest(job, "f", 2, b"", {}, [], "/", keep_alive=keep_alive, world_key="k", session=session)


def test_a_local_call_names_a_new_pool_then_the_next_call_takes_it():
    """The first hot call gets a new pool id; once it is gone clean, the next call of its world runs in that pool."""
    keeper, client, told = Keeper(timers=False), Client(), []
    assert worlds.take(keeper, request(keep_alive=None), client, told.append) is None, "no keep_alive: no world"
    first = worlds.take(keeper, request("j1"), client, told.append)
    assert first is not None and first.busy and first.client is client
    call = CallWorld(keeper, first, 2)
    for rank in (0, 1):
        call.exited(p.RankExited("j1", rank, 0, 1.0))
    call.gone()
    assert not first.busy and keeper.worlds(LocalWorld) == [first]
    second = worlds.take(keeper, request("j2"), client, told.append)
    assert second is first and second.call == "j2" and client.sent == []


def test_an_unusable_rank_ends_the_world_and_a_sessions_end_is_said_to_its_call():
    """A rank whose process is unfit ends the world (EndPool to the helper); a session's rank that raised but stays
    usable keeps it; the helper's own end (PoolEnded) is said to the call running in it."""
    keeper, client, told = Keeper(timers=False), Client(), []
    plain = worlds.take(keeper, request("j1"), client, told.append)
    assert plain is not None
    CallWorld(keeper, plain, 2).exited(p.RankExited("j1", 0, 1, 1.0, usable=False))
    assert keeper.worlds() == [] and client.sent == [
        p.EndPool(plain.pool, "rank 0 raised an error that leaves it unusable")
    ]

    session = worlds.take(keeper, request("j2", session="s"), client, told.append)
    assert session is not None
    call = CallWorld(keeper, session, 2)
    call.exited(p.RankExited("j2", 0, 1, 1.0, usable=True))
    call.exited(p.RankExited("j2", 1, 0, 1.0))
    call.gone()
    assert keeper.session("s", LocalWorld) is session and not session.busy

    with pytest.raises(SessionBusy):
        worlds.take(keeper, request("j3", session="s"), client, told.append) and worlds.take(
            keeper, request("j4", session="s"), client, told.append
        )
    worlds.pool_ended(keeper, Client(), p.PoolEnded(session.pool, "another helper's pool"))
    assert keeper.session("s", LocalWorld) is session, "a PoolEnded of another helper is not this world's"
    worlds.pool_ended(keeper, client, p.PoolEnded(session.pool, "rank 1 (pid 12) was killed by SIGKILL"))
    assert told == [p.SessionEnded("j3", "s", "rank 1 (pid 12) was killed by SIGKILL")]
    assert keeper.worlds() == [] and len(client.sent) == 1, "the helper ended it: nothing is asked of it"


def test_a_replaced_helpers_idle_worlds_end_and_the_calls_own_moves():
    """A stale helper's idle worlds end, said for a session; the call's own world moves to the new helper."""
    keeper, old, new = Keeper(timers=False), Client(), Client()
    idle_session = worlds.take(keeper, request("j1", session="s"), old, lambda e: None)
    assert idle_session is not None
    keeper.done(idle_session)
    mine = worlds.take(keeper, request("j2"), old, lambda e: None)
    worlds.moved(keeper, old, new, mine)
    assert keeper.worlds() == [mine] and mine is not None and mine.client is new
    assert named(keeper) == [("s", "the helper was replaced")]
