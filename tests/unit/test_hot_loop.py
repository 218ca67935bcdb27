"""A hot rank's loop (launch/rank/hot.py), as plain objects: the local rank's pipes and the Ray rank's actor are its
two transports, and the loop itself decides what each call's end leads to (no process is started)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from air_magic.launch.rank import hot, worker
from air_magic.launch.ray.rank import RankActor


class Script:
    """A transport that brings the given run directories (None: the release) and records what it is told."""

    tidy_after = 0.0

    def __init__(self, calls: list[Path | None], listening: bool = True) -> None:
        self.calls, self.listening = list(calls), listening
        self.reports: list[tuple[int, bool]] = []

    def report(self, code: int, kept: bool) -> bool:
        self.reports.append((code, kept))
        return self.listening

    def ready(self, timeout: float) -> bool:
        return bool(self.calls) and self.calls[0] != Path("late")

    def take(self) -> Path | None:
        path = self.calls.pop(0)
        return Path("on-time") if path == Path("late") else path


class Calls:
    """Stands in for worker.py: each call's code is its run directory's name ("3-kept": 3, the session kept)."""

    session_kept = False

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.ended = 0

    def run(self, path: Path, rank: int) -> int:
        self.runs.append(path.name)
        code, _, kept = path.name.partition("-")
        self.session_kept = kept == "kept"
        return int(code) if code.isdigit() else 0

    def end_call(self) -> None:
        self.ended += 1


@pytest.fixture
def ran(monkeypatch):
    """The calls run, and the tidy-ups counted."""
    tidied: list[bool] = []
    monkeypatch.setattr(hot, "tidy", lambda: tidied.append(True))
    return Calls(), tidied


def test_a_hot_rank_runs_each_call_it_is_given_until_it_is_released(ran):
    """Every call's end is said, the next one runs, and the release ends the loop with 0."""
    transport = Script([Path("0"), Path("0"), None])
    assert hot.serve(0, 0, transport, ran[0]) == 0
    assert ran[0].runs == ["0", "0"]
    assert transport.reports == [(0, False)] * 3 and ran[0].ended == 3


def test_a_failed_call_ends_the_loop_with_its_code_unsaid(ran):
    """A call that fails and leaves the rank unusable ends the loop: its code is the rank's exit, not a report."""
    transport = Script([Path("7"), Path("0")])
    assert hot.serve(0, 0, transport, ran[0]) == 7
    assert transport.reports == [(0, False)]
    assert hot.serve(5, 0, Script([]), ran[0]) == 5


def test_a_session_call_that_leaves_the_rank_usable_is_reported_kept(ran):
    """A session call whose error keeps the rank is said as "kept", and the rank waits for the next call."""
    transport = Script([Path("3-kept"), None])
    assert hot.serve(0, 0, transport, ran[0]) == 0
    assert transport.reports == [(0, False), (3, True)]


def test_the_rank_tidies_up_only_when_no_call_came_at_once(ran):
    """A call already waiting runs first; one that is late finds the rank tidied up."""
    hot.serve(0, 0, Script([Path("0"), None]), ran[0])
    assert ran[1] == []
    hot.serve(0, 0, Script([Path("late"), None]), ran[0])
    assert ran[1] == [True]


def test_no_one_listening_ends_the_loop(ran):
    """A report no one reads (the helper is gone) ends the loop with 0 and runs nothing more."""
    assert hot.serve(0, 0, Script([Path("0")], listening=False), ran[0]) == 0
    assert ran[0].runs == []


def test_the_local_ranks_pipes_carry_the_ends_and_the_release():
    """The helper reads "0" or "<code> kept" on the done pipe; end-of-file on the command pipe releases the rank."""
    cmd_r, cmd_w = os.pipe()
    done_r, done_w = os.pipe()
    try:
        pipes = hot.Pipes(f"{cmd_r},{done_w}", 1)
        assert pipes.report(0, False) and pipes.report(3, True)
        assert os.read(done_r, 100) == b"0\n3 kept\n"
        assert not pipes.ready(0.0)
        os.close(cmd_w)
        assert pipes.ready(0.0) and pipes.take() is None
        os.close(done_r)
        assert not pipes.report(0, False)
    finally:
        for fd in (cmd_r, done_w):
            os.close(fd)


def test_the_ray_rank_is_the_same_loops_transport(ran):
    """A hot Ray actor runs the same loop: `start` queues the next call, each end is what `poll` reports."""
    actor = RankActor("/nonexistent")
    actor.preloading.join()
    assert not actor.ready(0.0)
    loop = threading.Thread(target=lambda: actor.report(hot.serve(0, 0, actor, ran[0]), False))
    loop.start()
    assert actor.done.wait(10) and actor.code == 0
    actor.done.clear()
    actor.calls_in.put(Path("3-kept"))
    assert actor.done.wait(10) and (actor.code, actor.kept) == (3, True)
    actor.done.clear()
    actor.calls_in.put(Path("9"))
    loop.join(10)
    assert not loop.is_alive() and actor.code == 9 and ran[0].runs == ["3-kept", "9"]


def test_both_launchers_ranks_hand_the_loop_the_worker_itself():
    """What the loop runs each call with is worker.py, in a local rank and a Ray rank alike."""
    calls: hot.Calls = worker
    assert calls.run is worker.run and calls.end_call is worker.end_call and calls.session_kept is worker.session_kept
