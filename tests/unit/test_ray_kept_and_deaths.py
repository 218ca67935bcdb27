"""What Ray holds and says, as plain objects: the spares' default, the listing of kept actors, and the error for a
worker that did not register in time, with its exit and the tail of its log (no Ray, no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from air_magic.launch.ray import _compat, cluster, worker_log
from air_magic.launch.ray.deaths import REGISTER_TIMEOUT_ENV, WorkerNotRegistered, not_registered
from air_magic.launch.ray.hot import HotWorld
from air_magic.launch.ray.launcher import held_line
from air_magic.launch.ray.placement import LaunchError
from air_magic.launch.ray.starting import RESTARTED, Starting

#: Ray's words for an actor whose worker the raylet ended before it registered (the exit detail of Ray 2.60).
BARE = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: RankActor\n\tactor_id: 5f2c\n\t"
    "pid: 4242\n\tnamespace: 0e1f\n\tip: 127.0.0.1\nThe actor is dead because its worker process has died. "
    "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. "
    "End of file. Some common causes include: (1) the process was killed by the OOM killer due to high memory usage"
)


class ActorDiedError(Exception):
    """Stands in for ray.exceptions.ActorDiedError (named the same; tests/unit imports no Ray)."""


class FailsAtFirstAnswer(Starting):
    """A call's start whose actors' first answers (`where`) fail with `errors[rank]` the first `deaths` times they are
    asked (an actor started again answers); Ray's get, kill and the placement are recorded, not asked of Ray."""

    class Actor:
        def __init__(self, rank: int, start: int) -> None:
            self.rank, self.start = rank, start
            outer = self

            class where:  # the shape of a Ray actor method
                @staticmethod
                def remote(first: bool) -> tuple:
                    return ("where", outer)

            self.where = where

    def __init__(self, errors: dict[int, BaseException], deaths: int = 2) -> None:
        import queue

        self.errors, self.deaths, self.asked, self.killed = errors, deaths, 0, []
        self.actors = [self.Actor(rank, 0) for rank in range(2)]
        self.events = queue.Queue()
        self.job, self.pg, self.runtime_env = "job", "pg", None
        fake = self

        class Ray:
            @staticmethod
            def get(ref, timeout=None):
                return fake._answer(ref[1])

            @staticmethod
            def kill(actor, no_restart):
                fake.killed.append((actor.rank, actor.start, no_restart))

        class Placement:
            @staticmethod
            def actor(actor_cls, pg, rank, runtime_env):
                return fake.Actor(rank, fake.asked)

        class Launcher:
            @staticmethod
            def actor_class():
                return "RankActor"

        self.ray, self.placement, self.launcher = Ray(), Placement(), Launcher()

    def _answer(self, actor):
        if actor.rank in self.errors and actor.start < self.deaths:
            raise self.errors[actor.rank]
        return f"place of rank {actor.rank}"

    def _wait(self, refs: list, limit: float, what: str) -> list:
        self.asked += 1
        return [self._answer(actor) for _, actor in refs]

    def _start_calls(self, master, port):
        self.started_at = (master, port)


def test_a_worker_that_died_before_it_answered_is_started_again_once_and_said():
    """Ray's bare "connection error code 2" death at rank 1's first answer: rank 1's actor (which ran no code of the
    call) is killed and asked for again in its bundle, its output says so, and the call starts."""
    start = FailsAtFirstAnswer({1: ActorDiedError(BARE)}, deaths=1)
    assert start._where_each() == ["place of rank 0", "place of rank 1"]
    assert start.killed == [(1, 0, True)] and [a.start for a in start.actors] == [0, 1]
    said = start.events.get_nowait()
    assert (said.rank, said.text) == (1, f"air_magic: {RESTARTED}\n") and start.events.empty()


def test_a_worker_that_died_twice_before_it_answered_is_named_with_its_setting_raised_from_rays_error():
    """The same death again after the one start again becomes a LaunchError that quotes Ray's own words, names the
    causes Ray has for it (not one as certain) and RAY_worker_register_timeout_seconds, raised from Ray's error."""
    bare = ActorDiedError(BARE)
    start = FailsAtFirstAnswer({1: bare})
    with pytest.raises(WorkerNotRegistered) as caught:
        start._start_ranks()
    error = caught.value
    assert isinstance(error, LaunchError) and error.__cause__ is bare
    assert "died before any code of the call ran" in str(error) and REGISTER_TIMEOUT_ENV in str(error)
    assert "connection error code 2" in str(error) and "OOM killer" in str(error)
    assert "The dead worker process: pid 4242 on node 127.0.0.1; its exit, as Ray saw it: SYSTEM_ERROR" in str(error)
    assert "no exit code or signal of it is known" in str(error)
    assert start.asked == 2 and start.killed == [(1, 0, True)]


#: Ray's words for another death at a rank's first answer: its node died (no worker process to tell of).
NODE_DIED = "The actor died because its node died. Worker exit type: NODE_DIED"


def test_other_errors_at_the_first_answer_are_left_as_they_are():
    """The EOF words outside an actor death, or no death at all, are not read as a registration timeout and are
    raised as they are."""
    for other in (
        RuntimeError("connection error code 2"),
        LaunchError("starting the ranks' Ray actors did not happen within 300 s"),
    ):
        assert not_registered(other) is None
        with pytest.raises(type(other)) as caught:
            FailsAtFirstAnswer({0: other})._start_ranks()
        assert caught.value is other


def test_another_actor_death_at_the_first_answer_is_said_in_rays_words_and_not_started_again():
    """An actor death of another kind is no registration timeout: no start again, a LaunchError (not the timeout's)
    that quotes Ray, raised from Ray's error."""
    bare = ActorDiedError(NODE_DIED)
    assert not_registered(bare) is None
    start = FailsAtFirstAnswer({0: bare})
    with pytest.raises(LaunchError) as caught:
        start._start_ranks()
    error = caught.value
    assert not isinstance(error, WorkerNotRegistered) and error.__cause__ is bare
    assert (
        f"a rank's Ray actor died before it answered, before any code of the call ran. Ray's own words: {NODE_DIED}"
        == str(error)
    )
    assert start.asked == 1 and start.killed == []


@pytest.fixture
def session_here(tmp_path, monkeypatch):
    """A Ray session directory on this machine, node ip 10.1.2.3: what `_compat.local_session` says of it."""
    (tmp_path / "logs" / "old").mkdir(parents=True)
    monkeypatch.setattr(_compat, "local_session", lambda: (str(tmp_path), "10.1.2.3"))
    return tmp_path


def write_worker_logs(session, pid: int, err: str, out: str = "") -> Path:
    """A dead worker's two logs as Ray leaves them (its log monitor's tags first; moved to logs/old); the .err."""
    name = session / "logs" / "old" / f"worker-{'ab' * 28}-01000000-{pid}"
    for suffix, text in ((".err", err), (".out", out)):
        name.with_suffix(suffix).write_text(f":job_id:01000000\n:actor_name:RankActor\n{text}")
    return name.with_suffix(".err")


def test_a_worker_that_died_twice_is_said_with_the_tail_of_its_log_where_that_is_on_this_machine(session_here):
    """The second death's error says the worker's pid, node and exit, and quotes the last lines of its .err and .out
    (Ray's tags left out, at most 20 lines and 2000 characters of each) with their paths."""
    many = "".join(f"line {i}\n" for i in range(40))
    err = write_worker_logs(session_here, 4242, many + "Fatal: marker of the dying worker\n", "x" * 5000 + "\n")
    write_worker_logs(session_here, 14242, "another worker's line\n")
    with pytest.raises(WorkerNotRegistered) as caught:
        FailsAtFirstAnswer({1: ActorDiedError(BARE)})._start_ranks()
    said = str(caught.value)
    assert "The dead worker process: pid 4242 on node 127.0.0.1" in said
    assert f"Its log {err} ends:\n" in said and "\n    line 21\n" in said and "line 20" not in said
    assert "\n    Fatal: marker of the dying worker\n" in said
    out = said[said.index(f"Its log {err.with_suffix('.out')} ends:\n    ...xxx") :]
    assert len(out) < worker_log.TAIL_CHARS + 200
    assert ":job_id:" not in said and "another worker" not in said


def test_a_worker_log_on_another_machine_is_named_with_its_node(session_here):
    """A worker of a node at another address: its log's place and the node are named, nothing is read here."""
    write_worker_logs(session_here, 4242, "a line of a local process of the same pid\n")
    remote = BARE.replace("ip: 127.0.0.1", "ip: 10.9.9.9")
    with pytest.raises(WorkerNotRegistered) as caught:
        FailsAtFirstAnswer({1: ActorDiedError(remote)})._start_ranks()
    said = str(caught.value)
    assert "The dead worker process: pid 4242 on node 10.9.9.9" in said
    assert (
        f"Its log is worker-*-*-4242.err and .out in {session_here / 'logs'} on node 10.9.9.9 (not readable from "
        "this machine)" in said
    )
    assert "a line of a local process" not in said


@pytest.fixture
def no_spares_kept(monkeypatch):
    """ray_init's decision alone: what turning spares off would end is recorded, not asked of Ray."""
    ended: list[str] = []
    monkeypatch.setattr(cluster, "_end_spares", [lambda: ended.append("spares")])
    monkeypatch.setattr(cluster, "_spare_idle", cluster.spare_idle())
    monkeypatch.setattr(cluster, "_started_here", False)
    return ended


def test_spares_are_on_by_default_only_for_a_ray_started_here(no_spares_kept, monkeypatch):
    """Default spares: off (and any kept ended) on a joined cluster, 300 s where ray_init started Ray; True or a
    number turns them on anywhere."""
    cluster._set_spares(None)
    assert cluster.spare_idle() == 0 and no_spares_kept == ["spares"]
    cluster._set_spares(True)
    assert cluster.spare_idle() == cluster.SPARE_IDLE
    cluster._set_spares(120)
    assert cluster.spare_idle() == 120
    monkeypatch.setattr(cluster, "_started_here", True)
    cluster._set_spares(None)
    assert cluster.spare_idle() == cluster.SPARE_IDLE and no_spares_kept == ["spares"]


def test_the_listing_says_what_kept_actors_hold_and_when_they_end():
    """A spare set and an idle hot world: nodes, CPUs or GPUs per node, idle time and time left; a busy one runs."""
    spare = HotWorld("spare/2x1/False/torch/{}", ["a", "b"], None, [], "", 0, 300.0, busy=False, spare=True)
    spare.idle_since = 100.0
    assert held_line(spare, 112.0) == (
        "Ray spare actors: 2 node(s) with 1 CPU each; idle 12 s, ends after 288 s more idle "
        "(%distributed_release ends them)"
    )
    hot = HotWorld("0a1b/2x4/True", list("abcdefgh"), None, [], "127.0.0.1", 1234, 600.0)
    assert held_line(hot, 5.0).startswith("Ray hot ranks: 2 node(s) with 4 CPU and 4 GPU each; running a call")
