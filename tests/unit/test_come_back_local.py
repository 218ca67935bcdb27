"""The local supervisor interrupts a session's rank only once the rank said it took the call: a SIGINT sent before
would be lost (the rank ignores SIGINT between calls), and the cell would run whole. No process is started: the
supervisor's table is driven directly and its signals are recorded."""

from __future__ import annotations

import os
import signal
import time

import pytest

from air_magic.launch import stacks
from air_magic.launch.come_back import COME_BACK, Interrupt
from air_magic.launch.local import supervisor as supervisor_module
from air_magic.launch.local.jobs import Job
from air_magic.launch.local.pool import Pool
from air_magic.launch.local.supervisor import Supervisor


@pytest.fixture
def signals(monkeypatch):
    """(pid, signal) of every os.kill the supervisor makes; the stop it would make instead is recorded too."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(supervisor_module.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def test_a_rank_that_has_not_taken_the_session_call_is_interrupted_only_once_it_says_so(signals, monkeypatch):
    sup = Supervisor(warm=False)
    stops: list[str] = []
    monkeypatch.setattr(sup, "stop", lambda job, grace, why="": stops.append(why))
    monkeypatch.setattr(sup, "processes", lambda job: {})
    asked: list[list[int]] = []
    monkeypatch.setattr(stacks, "request", lambda pids, tree: asked.append(pids))
    done_r, done_w = os.pipe()
    pool = Pool("world", 2, session="s", call="job")
    pool.done[1] = done_r
    sup.pools.add(pool)
    job = Job("job", 2, pids={0: 1000, 1: 1001}, pool=pool)
    job.took.add(0)
    sup.jobs[job.id] = job
    job.interrupt = Interrupt(time.monotonic(), "Ctrl-C")
    try:
        sup.interrupt_session(job, job.interrupt)
        assert signals == [(1000, signal.SIGINT)]  # rank 1 is still loading the call: its SIGINT would be lost
        sup.interrupt_session(job, job.interrupt)
        assert signals == [(1000, signal.SIGINT)]  # each rank once
        os.write(done_w, b"took\n")
        sup.read_done(pool, 1)
        assert job.took == {0, 1}
        sup.interrupt_session(job, job.interrupt)
        assert signals == [(1000, signal.SIGINT), (1001, signal.SIGINT)]
        assert stops == []
        job.interrupt.sent[0] -= COME_BACK * 2  # rank 0's time is over; rank 1's counts from its own interrupt
        sup.interrupt_session(job, job.interrupt)
        assert len(stops) == 1 and "rank(s) 0 did not come back" in stops[0]
        assert asked == [[1000, 1001]]  # the running ranks' stacks, into their logs, before the stop
    finally:
        os.close(done_w)
        pool.close_fds()
