"""RayLauncher's hot worlds as plain objects: which call takes one, when one ends (no Ray, no processes)."""

from __future__ import annotations

import pytest

from air_magic.launch import protocol as p
from air_magic.launch.keeper import Keeper
from air_magic.launch.ray import hot as hot_module
from air_magic.launch.ray.hot import HotWorld, world_key
from air_magic.launch.ray.launcher import RayLauncher


@pytest.fixture
def ended(monkeypatch):
    """The actors of every hot world ended, instead of asking Ray to end them."""
    gone: list[list[str]] = []
    monkeypatch.setattr(hot_module, "require_connected", lambda: None)
    monkeypatch.setattr(hot_module, "end_actors", lambda ray, actors, pg, grace, ran=True: gone.append(actors))
    return gone


def request(key: str = "k", keep_alive: float | None = 30.0, nodes: int = 2) -> p.JobRequest:
    return p.JobRequest(
        job_id="j",
        name="f",
        world_size=2 * nodes,
        payload=b"",
        env={},
        sys_path=[],
        cwd="/",
        keep_alive=keep_alive,
        world_key=key,
        num_nodes=nodes,
    )


def world(req: p.JobRequest, actors: list[str], keep_alive: float = 30.0) -> HotWorld:
    return HotWorld(world_key(req), actors, None, [], "127.0.0.1", 1234, keep_alive)


def test_the_next_call_of_the_same_world_takes_the_idle_hot_world(ended):
    """Same world key and shape: the kept world, now busy; a second call meanwhile gets none."""
    launcher = RayLauncher(Keeper())
    w = world(request(), ["a0", "a1"])
    launcher.keep(w)
    assert launcher.take_hot(request()) is w and w.busy
    assert launcher.take_hot(request()) is None
    assert ended == []
    launcher.drop(w)


def test_a_call_of_another_world_or_shape_gets_no_hot_world_and_leaves_the_idle_one(ended):
    """Another world key, another node count, or no keep_alive: no hot world for it; the idle one stays."""
    launcher = RayLauncher(Keeper())
    kept = world(request(), ["a0"])
    launcher.keep(kept)
    for other in (request(key="other"), request(nodes=1), request(keep_alive=None)):
        assert launcher.take_hot(other) is None
    assert launcher.hot_worlds() == [kept] and not kept.busy and ended == []
    launcher.release_hot()
    assert ended == [["a0"]]


def test_an_idle_world_ends_after_keep_alive_but_not_while_a_call_runs_in_it(ended):
    """Idle `keep_alive` s ends it; taken before that, its timer does nothing."""
    launcher = RayLauncher(Keeper())
    busy = world(request(key="busy"), ["b"], keep_alive=0.2)
    launcher.keep(busy)
    armed = busy.timer
    assert armed is not None and launcher.take_hot(request(key="busy")) is busy
    idle = world(request(), ["i"], keep_alive=0.2)
    launcher.keep(idle)
    timers = [armed, idle.timer]
    for timer in timers:  # each timer has done what it was to do once its thread has ended
        assert timer is not None
        timer.join(10)
    assert not any(timer.is_alive() for timer in timers)
    assert ended == [["i"]]
    assert launcher.hot_worlds() == [busy]
    launcher.drop(busy)


def test_release_ends_idle_worlds_and_shutdown_ends_every_world(ended):
    """release_hot leaves a world a call runs in; shutdown ends it too."""
    launcher = RayLauncher(Keeper())
    launcher.keep(world(request(key="idle"), ["i"]))
    running = world(request(key="running"), ["r"])
    launcher.keep(running)
    launcher.take_hot(request(key="running"))
    launcher.release_hot()
    assert ended == [["i"]] and launcher.hot_worlds() == [running]
    launcher.shutdown()
    assert ended == [["i"], ["r"]] and launcher.hot_worlds() == []


def test_a_spare_set_is_taken_by_its_shape_only_never_as_a_hot_world_and_ends_with_release(ended):
    """A spare set waits beside the hot worlds: a call of its shape takes it (once), no call takes it as a hot world,
    hot_worlds() does not list it, and release_hot ends it."""
    launcher = RayLauncher(Keeper())
    spare = HotWorld("spare/2x2", ["s"], None, [], "", 0, 30.0, busy=False, spare=True)
    launcher.keep(spare)
    assert launcher.take_hot(request()) is None and launcher.hot_worlds() == []
    assert launcher.take_spare("spare/1x2") is None
    assert launcher.take_spare("spare/2x2") is spare and launcher.take_spare("spare/2x2") is None
    other = HotWorld("spare/1x2", ["o"], None, [], "", 0, 30.0, busy=False, spare=True)
    launcher.keep(other)
    assert launcher.spare_sets() == [other] and launcher.holding()
    launcher.release_hot()
    assert ended == [["o"]] and not launcher.holding()


def test_a_call_waiting_for_placement_ends_idle_hot_ranks_only_when_what_is_free_cannot_hold_it(monkeypatch):
    """One CPU free on each of two nodes holds a call of one rank per node (its group is about to be placed, idle hot
    ranks and spares stay); a call of two per node needs what they hold; unknown free resources end them as before."""
    import dataclasses

    from air_magic.launch.ray import placement

    free: dict | None = {"head": {}, "a": {"CPU": 1.0}, "b": {"CPU": 1.0, "GPU": 1.0}}
    monkeypatch.setattr(placement, "free_per_node", lambda: free)
    one_per_node = dataclasses.replace(request(), world_size=2)
    assert placement.Placement(None, one_per_node).free_now()
    assert not placement.Placement(None, request()).free_now()
    free = None
    assert not placement.Placement(None, one_per_node).free_now()
