"""The load factor of the waits in which another process must answer, and the waits it stretches."""

from __future__ import annotations

import os

import pytest

from air_magic.launch import load
from air_magic.launch.come_back import COME_BACK, Interrupt


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


def test_a_session_rank_is_given_longer_to_come_back_on_a_busy_machine_and_the_note_says_how_long(two_cores):
    """On an idle machine a session's ranks have COME_BACK s to return from KeyboardInterrupt; at a load of 17 on 2
    cores, 8.5 times that, fixed when the interrupt is made; the note of an end names the time they were given."""
    two_cores(0.5)
    idle = Interrupt(100.0, "Ctrl-C")
    assert idle.give_up_at == 100.0 + COME_BACK
    assert "did not come back from KeyboardInterrupt within 5 s" in idle.not_back("1")
    two_cores(17.0)
    busy = Interrupt(100.0, "Ctrl-C")
    two_cores(0.5)  # the load falls afterwards: the time given stays
    assert busy.give_up_at == 100.0 + 8.5 * COME_BACK
    note = busy.not_back("0, 1")
    assert "rank(s) 0, 1 did not come back from KeyboardInterrupt within 42.5 s" in note and "Ctrl-C" in note
