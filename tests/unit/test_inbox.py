"""The helper's inbox: which requests interrupt a background preparation and which let it go on."""

from __future__ import annotations

import os

import pytest

from air_magic.launch import protocol as p
from air_magic.launch.local.inbox import Inbox


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield Inbox(r), w
    os.close(r)
    try:
        os.close(w)
    except OSError:
        pass


def _launch(job: str, run_dir: str) -> p.LaunchJob:
    return p.LaunchJob(job, 2, True, "python", [], run_dir, {}, "")


def _send(fd: int, *messages: p.Message) -> None:
    os.write(fd, b"".join(p.encode(m) for m in messages))


def test_requests_for_preparations_are_taken_without_interrupting_one(pipe):
    inbox, w = pipe
    taken = []
    _send(w, p.PrepareHooks(["hook"], {"URI": "x"}))
    assert not inbox.must_give_way("hook", taken.append, lambda payload: [])
    assert taken == [p.PrepareHooks(["hook"], {"URI": "x"})]
    assert inbox.next() is None


def test_a_launch_waits_for_the_preparation_its_ranks_need_and_interrupts_one_they_do_not(pipe, tmp_path):
    inbox, w = pipe
    asked = []

    def needed_by(payload):
        asked.append(payload)
        return ["hook"] if payload.parent.name == "needs" else []

    _send(w, _launch("a", str(tmp_path / "needs")))
    assert not inbox.must_give_way("hook", print, needed_by)
    assert not inbox.must_give_way("hook", print, needed_by)
    assert len(asked) == 1, "the payload is read once per launch, not at every module the preparation loads"
    assert inbox.must_give_way("other", print, needed_by)
    _send(w, _launch("b", str(tmp_path / "plain")))
    assert inbox.must_give_way("hook", print, needed_by)
    assert [m.job for m in iter(inbox.next, None)] == ["a", "b"], "requests are handled in the order they came"


def test_any_other_request_and_a_closed_pipe_interrupt_it(pipe):
    inbox, w = pipe
    _send(w, p.EndPool("p", "released"))
    assert inbox.must_give_way("hook", print, lambda payload: ["hook"])
    assert isinstance(inbox.next(), p.EndPool)
    assert not inbox.must_give_way("hook", print, lambda payload: ["hook"])
    os.close(w)
    assert inbox.must_give_way("hook", print, lambda payload: ["hook"])
    assert inbox.eof
