"""The load factor of the waits in which another process must answer, and the waits it stretches."""

from __future__ import annotations

import os

import pytest

from air_magic.launch import load
from air_magic.launch.come_back import COME_BACK, LONGEST_COME_BACK, RUNNING_PATIENCE, Interrupt


@pytest.fixture
def two_cores(monkeypatch):
    """This machine has 2 cores and the load average the test sets."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)

    def at(average: float) -> None:
        monkeypatch.setattr(os, "getloadavg", lambda: (average, average, average))

    return at


def test_the_limits_stretch_with_the_load_per_core_within_a_bound(two_cores, monkeypatch):
    """A busy machine gives each process longer to be scheduled and answer (the load average per core), never less
    than on an idle one, and never without bound."""
    for average, stretch in ((0.3, 1.0), (2.0, 1.0), (17.0, 8.5), (400.0, 10.0)):
        two_cores(average)
        assert load.patience() == stretch

    def no_load_average() -> tuple[float, float, float]:
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", no_load_average)
    assert load.patience() == 1.0


def test_a_session_rank_in_its_code_has_come_back_time_from_its_interrupt_stretched_at_most_twice(two_cores):
    """A rank interrupted in its user code has COME_BACK s from its own interrupt on an idle machine, at most twice
    that on a busy one (fixed when the interrupt is made); the note of an end names the ranks and the time given."""
    two_cores(0.5)
    idle = Interrupt(100.0, "Ctrl-C")
    assert idle.send_to([0, 1], 99.0, in_code=True) == []  # not before `at`
    assert idle.send_to([0, 1], 100.5, in_code=True) == [0, 1]
    assert idle.send_to([0, 1], 101.0, in_code=True) == []  # each once
    assert idle.late([0, 1], 100.5 + COME_BACK - 0.1) == []
    assert idle.late([0, 1], 100.5 + COME_BACK) == [0, 1]
    assert "rank(s) 0, 1 did not come back from KeyboardInterrupt within 5 s" in idle.not_back([0, 1])
    two_cores(17.0)
    busy = Interrupt(100.0, "Ctrl-C")
    two_cores(0.5)  # the load falls afterwards: the time given stays
    busy.send_to([1], 100.0, in_code=True)
    assert busy.late([1], 100.0 + RUNNING_PATIENCE * COME_BACK - 0.1) == []
    assert busy.late([1], 100.0 + RUNNING_PATIENCE * COME_BACK) == [1]
    assert "within 10 s" in busy.not_back([1]) and "Ctrl-C" in busy.not_back([1])


def test_a_rank_not_yet_in_its_code_has_until_the_longest_come_back_and_then_its_own_time(two_cores):
    """A rank still loading the call (not said to have taken it) is not given up on before `at + LONGEST_COME_BACK`;
    once it is interrupted in its code, its own short time counts from then."""
    two_cores(0.5)
    asked = Interrupt(100.0, "the timeout")
    assert asked.send_to([0], 100.0, in_code=True) == [0]  # rank 1 has not taken the call
    assert asked.late([0, 1], 100.0 + COME_BACK) == [0]
    assert asked.late([1], 100.0 + LONGEST_COME_BACK - 0.1) == []
    assert asked.late([1], 100.0 + LONGEST_COME_BACK) == [1]
    assert f"within {LONGEST_COME_BACK:.3g} s" in asked.not_back([1])
    assert asked.send_to([1], 130.0, in_code=True) == [1]  # it took the call late
    assert asked.late([1], 130.0 + COME_BACK - 0.1) == []
    assert asked.late([1], 130.0 + COME_BACK) == [1]
    ray_rank = Interrupt(100.0, "Ctrl-C")
    ray_rank.send_to([0], 100.0, in_code=False)  # sent before knowing where the rank is
    assert ray_rank.late([0], 100.0 + COME_BACK) == []
    ray_rank.in_code.add(0)  # its answer: raised in its code
    assert ray_rank.late([0], 100.0 + COME_BACK) == [0]
