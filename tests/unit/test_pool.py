"""The hot pools' bookkeeping as a plain object: which pool a call may use, done lines, idle expiry, release."""

from __future__ import annotations

import os

import pytest

from air_magic.launch.local.pool import Pool, Pools


def _pool(key: str = "k", size: int = 2, keep_alive: float = 60.0, job: str | None = None) -> Pool:
    return Pool(key, size, keep_alive, port=1234, job=job, idle_since=None if job else 100.0)


def test_a_call_gets_an_idle_pool_of_its_world_only():
    """Only an idle pool with the same world key and size runs the next call."""
    pools = Pools()
    busy, other, good = _pool(job="running"), _pool(key="other"), _pool()
    for pool in (busy, other, good):
        pools.add(pool)
    assert pools.idle("k", 2) is good
    assert pools.idle("k", 3) is None
    assert pools.idle("nope", 2) is None


def test_done_lines_are_read_across_chunks():
    """A rank's "<code>" lines may arrive split or together; each finished line is one exit code (and whether the
    rank stays usable)."""
    pool = _pool()
    assert pool.feed(0, b"0") == []
    assert pool.feed(0, b"\n1\n") == [(0, True), (1, False)]
    assert pool.feed(1, b"\n") == [(1, False)], "an empty line counts as a failure"


def test_an_idle_pool_is_released_after_keep_alive():
    """A pool idle for its keep_alive seconds is released; a busy one or a younger one stays."""
    pools = Pools()
    old, young, busy = _pool(keep_alive=10), _pool(keep_alive=1000), _pool(job="running")
    for pool in (old, young, busy):
        pools.add(pool)
    pools.tick(now=100.0 + 10)
    assert pools.pools == [young, busy]
    pools.tick(now=100.0 + 11)
    assert not pools.releasing, "a released pool with no process left is forgotten"


def test_release_closes_the_pools_pipes():
    """Releasing a pool closes its command and done pipes, which is how its ranks learn to exit."""
    pools = Pools()
    pool = _pool()
    cmd_r, cmd_w = os.pipe()
    done_r, done_w = os.pipe()
    pool.cmd[0], pool.done[0] = cmd_w, done_r
    pools.add(pool)
    assert pools.done_fds() == {done_r: (pool, 0)} and sorted(pools.fds()) == sorted([cmd_w, done_r])
    try:
        pools.release(pool)
        assert pools.pools == [] and pools.fds() == []
        assert os.read(cmd_r, 1) == b"", "end-of-file on the command pipe"
        with pytest.raises(OSError):
            os.fstat(done_r)
        pools.release(pool)  # twice is harmless
    finally:
        os.close(cmd_r)
        os.close(done_w)


def test_release_idle_keeps_a_pool_that_runs_a_call():
    """%distributed_release ends idle pools; one running a call ends with that call instead."""
    pools = Pools()
    idle, busy = _pool(), _pool(job="running")
    busy.pids[0], busy.store_pid = 11, 12
    pools.add(idle)
    pools.add(busy)
    pools.release_idle()
    assert pools.pools == [busy]
    assert pools.holding(11) == [busy] and pools.holding(99) == [] and pools.store_pids() == {12}
