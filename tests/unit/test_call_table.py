"""The table of a process's calls (calls/table.py): numbers, ids, finding a call one way, and the end event."""

from __future__ import annotations

import threading

import pytest

from air_magic.calls.table import CallTable, UnknownCall
from air_magic.errors import ConfigurationError


class _Call:
    """What the table reads of a call, and nothing else."""

    def __init__(self, run_dir_name: str | None = None, session: str | None = None) -> None:
        self.number = 0
        self.run_dir_name = run_dir_name
        self.session = session
        self.finished = threading.Event()

    def done(self) -> bool:
        return self.finished.is_set()


def test_calls_get_small_numbers_in_order_and_are_listed_oldest_first():
    table = CallTable()
    a, b, c = _Call("20261205-1-train-aa"), _Call(), _Call("20261205-3-cell-cc")
    assert [table.add(call) for call in (a, b, c)] == [1, 2, 3]
    assert [call.number for call in (a, b, c)] == [1, 2, 3]
    assert table.all() == [a, b, c]


def test_a_call_is_found_by_number_id_unique_prefix_or_path():
    table = CallTable()
    a, b = _Call("20261205-130102-train-ab12"), _Call("20261205-130907-cell-cd34")
    table.add(a)
    table.add(b)
    assert table.find(1) is a and table.find("2") is b
    assert table.find("20261205-130102-train-ab12") is a
    assert table.find("20261205-1309") is b, "a unique start of the id is enough"
    assert table.find("/home/me/.cache/air_magic/runs/20261205-130102-train-ab12") is a
    assert table.find(None) is b, "no id: the latest call"


def test_a_prefix_of_several_ids_is_an_error_naming_them():
    table = CallTable()
    for name in ("20261205-1-train-aa", "20261205-2-train-bb"):
        table.add(_Call(name))
    with pytest.raises(UnknownCall, match=r"names 2 calls: 1 \(20261205-1-train-aa\), 2 \(20261205-2-train-bb\)"):
        table.find("20261205-")


def test_an_unknown_call_is_a_configuration_error_listing_the_known_ones():
    table = CallTable()
    with pytest.raises(ConfigurationError, match="no call in this process yet"):
        table.find(None)
    table.add(_Call("20261205-1-train-aa"))
    table.add(_Call())  # waiting for its GPUs: no run directory, known by number
    with pytest.raises(LookupError, match=r"there is no call 999 in this process; known calls: 1, 2\."):
        table.find(999)


def test_the_running_call_of_a_session_makes_it_busy_until_it_ends():
    table = CallTable()
    first, second = _Call(session="s"), _Call(session="s")
    table.add(first)
    table.add(second)
    assert table.in_session("s") is first
    assert table.in_session("s", but=first) is second
    assert table.in_session("other") is None
    first.finished.set()
    second.finished.set()
    assert table.in_session("s") is None and table.running() == []


def test_an_ended_call_is_told_to_every_listener_and_a_failing_listener_changes_nothing():
    table = CallTable()
    told: list[object] = []

    def broken(call: object) -> None:
        raise RuntimeError("a listener's bug")

    table.on_end(broken)
    table.on_end(told.append)
    call = _Call()
    table.add(call)
    table.ended(call)
    assert told == [call]


def _spec(name: str = "train"):
    from air_magic.job import JobSpec

    return JobSpec(target=print, args=(), kwargs={}, name=name, world_size=2, accelerator_type="CPU", timeout=None)


def test_a_handles_run_directory_is_waited_for_on_an_event_and_names_the_call(tmp_path):
    """`run_dir` blocks until the runner's context arrives (no sleep loop); the id is then the directory's name."""
    from air_magic.calls.handle import DistributedCall
    from air_magic.job import CallStatus
    from air_magic.listeners import RunContext

    call = DistributedCall(_spec())
    call.status = CallStatus.RUNNING
    run_dir = tmp_path / "20261205-130102-train-ab12"
    timer = threading.Timer(0.05, call.watch.on_start, [RunContext(call.spec, run_dir, [])])
    timer.start()
    assert call.run_dir == run_dir
    assert call.id == run_dir.name and call.run_dir_name == run_dir.name
    timer.join()


def test_a_call_that_ended_without_a_run_directory_says_so_at_once():
    from air_magic.calls.handle import DistributedCall
    from air_magic.errors import AirMagicError

    call = DistributedCall(_spec())
    call.error = RuntimeError("refused")
    call.background = False  # no record to write
    call._end()
    assert call.has_run_dir(timeout=0) is False
    with pytest.raises(AirMagicError, match="ended before it had a run directory"):
        _ = call.run_dir


def test_a_call_into_a_busy_session_is_refused_naming_the_call_that_holds_it():
    table = CallTable()
    holder = _Call(session="gpt2")
    table.add(holder)
    table.check_free("gpt2", holder)  # the call itself is not refused
    table.check_free(None)
    with pytest.raises(ConfigurationError, match=r"session 'gpt2' is busy: call 1 runs in it\. Wait for it"):
        table.check_free("gpt2", _Call(session="gpt2"))
