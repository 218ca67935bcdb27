"""The ledger of GPUs and CPU slots: calls at once never share a unit, a call waits in line, and says for what."""

from __future__ import annotations

import threading

import pytest

from air_magic.calls.ledger import CPU, GPU, Ledger
from air_magic.errors import ConfigurationError, JobCancelledError


def test_calls_at_once_get_disjoint_gpus_and_a_third_gets_none_until_one_gives_back():
    """Two calls of 2 GPUs on a 4-GPU node get disjoint GPUs; a third waits until one gives its GPUs back."""
    ledger = Ledger(["0", "1", "2", "3"], cpu_slots=2)
    first = ledger.take("a", 2, GPU)
    second = ledger.take("b", 2, GPU)
    assert first and second and not set(first) & set(second)
    assert ledger.take("c", 2, GPU) is None
    ledger.give_back("a")
    assert ledger.take("c", 2, GPU) == first


def test_a_holder_that_asks_again_gets_what_it_holds():
    """A session asking again (its next call) gets the same units back, not new ones."""
    ledger = Ledger(["0", "1"], cpu_slots=1)
    assert ledger.take("s", 1, GPU) == ("0",)
    assert ledger.take("s", 1, GPU) == ("0",)
    assert ledger.free(GPU) == ["1"]


def test_more_gpus_than_the_node_has_is_refused_naming_both_numbers():
    """Asking for 3 GPUs of a 2-GPU node is an error at once that names 3 and 2."""
    with pytest.raises(ConfigurationError, match=r"asks for 3 GPU\(s\) and this node has 2"):
        Ledger(["0", "1"], cpu_slots=1).take("a", 3, GPU)


def test_a_cpu_call_larger_than_the_slots_runs_once_every_slot_is_free():
    """4 CPU ranks on 2 slots take both slots when they are free, and wait while any is held."""
    ledger = Ledger([], cpu_slots=2)
    ledger.take("small", 1, CPU)
    assert ledger.take("big", 4, CPU) is None
    ledger.give_back("small")
    assert ledger.take("big", 4, CPU) == ("0", "1")


def test_why_waiting_names_the_holders_and_what_is_free():
    """The words a waiting call shows: how many units, how many free, and who holds them."""
    ledger = Ledger([], cpu_slots=2)
    ledger.take("call 1", 2, CPU, "call 1 (train)")
    assert ledger.why_waiting(2, CPU) == "2 CPU slot(s); 0 of 2 free, held by call 1 (train)"


def test_a_waiting_call_takes_its_units_when_they_are_given_back_first_come_first_served():
    """Two waiters get the units in the order they queued; a newcomer does not jump the line."""
    ledger = Ledger([], cpu_slots=2)
    ledger.take("running", 2, CPU)
    got: list[str] = []
    queued = [threading.Event(), threading.Event()]

    def wait(name: str, n: int) -> None:
        queued[n].set()
        ledger.wait_take(name, 2, CPU)
        got.append(name)
        ledger.give_back(name)

    first = threading.Thread(target=wait, args=("first", 0))
    first.start()
    queued[0].wait()
    while "first" not in ledger._queue:
        threading.Event().wait(0.01)
    assert ledger.take("newcomer", 2, CPU) is None  # someone waits already
    second = threading.Thread(target=wait, args=("second", 1))
    second.start()
    while "second" not in ledger._queue:
        threading.Event().wait(0.01)
    ledger.give_back("running")
    first.join(10)
    second.join(10)
    assert got == ["first", "second"]
    assert ledger.holders() == {}


def test_a_waiting_call_that_is_cancelled_leaves_the_line():
    """wait_take raises JobCancelledError once the call is cancelled, and no longer blocks the line."""
    ledger = Ledger([], cpu_slots=1)
    ledger.take("running", 1, CPU)
    with pytest.raises(JobCancelledError):
        ledger.wait_take("waiter", 1, CPU, cancelled=lambda: True)
    assert ledger._queue == []
    ledger.give_back("running")
    assert ledger.take("next", 1, CPU) == ("0",)


def test_a_call_borrows_what_a_kept_world_holds_and_gives_it_back_to_it():
    """A call in a kept world runs on that world's GPUs (borrowed first), and they stay the world's after."""
    ledger = Ledger(["0", "1", "2"], cpu_slots=1)
    ledger.take("call 1", 2, GPU)
    world = object()
    assert ledger.hand_over("call 1", world, "hot ranks kept by call 1")
    ledger.give_back("call 1")
    assert ledger.holders()[world].units == ("0", "1") and ledger.free(GPU) == ["2"]
    assert ledger.take("call 2", 2, GPU, borrow=lambda holder: holder is world) == ("0", "1")
    assert ledger.take("call 3", 2, GPU) is None, "borrowed units are not free to others"
    ledger.give_back("call 2")
    assert ledger.holders()[world].units == ("0", "1") and ledger.free(GPU) == ["2"]


def test_a_lender_that_ends_first_leaves_its_units_with_the_borrower():
    """A world that ends while a call runs on its units: they stay the call's until it gives them back."""
    ledger = Ledger(["0", "1"], cpu_slots=1)
    ledger.take("call 1", 2, GPU)
    world = object()
    ledger.hand_over("call 1", world, "session 's'")
    ledger.give_back("call 1")
    ledger.take("call 2", 2, GPU, borrow=lambda holder: holder is world)
    ledger.give_back(world)
    assert ledger.free(GPU) == [] and ledger.take("call 3", 1, GPU) is None
    ledger.give_back("call 2")
    assert ledger.free(GPU) == ["0", "1"]


def test_units_no_one_may_borrow_are_waited_for():
    """A world's units are not borrowed by a call its owner does not allow (another session's GPUs)."""
    ledger = Ledger(["0"], cpu_slots=1)
    ledger.take("call 1", 1, GPU)
    world = object()
    ledger.hand_over("call 1", world, "session 'a'")
    assert ledger.take("call 2", 1, GPU, borrow=lambda holder: False) is None
    assert "session 'a'" in ledger.why_waiting(1, GPU)
