"""ray_init's warm-up (launch/ray/cluster.py `prestart_workers`): a task per node, so that the first call finds a
worker started, except where Ray keeps no idle worker, where the worker would be gone before that call."""

from __future__ import annotations

import pytest

from air_magic.launch.ray import cluster


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(cluster, "_warming", None)
    monkeypatch.delenv("AIR_MAGIC_WARM", raising=False)
    return monkeypatch


def test_the_warm_up_is_skipped_where_ray_ends_idle_workers_at_once(fresh):
    fresh.setenv("RAY_num_workers_soft_limit", "0")
    cluster.prestart_workers()
    assert cluster.warming() is None


def test_the_warm_up_runs_where_ray_keeps_idle_workers(fresh):
    """With Ray's own limit (here 2) the warm-up starts; not connected to Ray, it gives up quietly."""
    fresh.setenv("RAY_num_workers_soft_limit", "2")
    cluster.prestart_workers()
    warming = cluster.warming()
    assert warming is not None
    warming.join(30)
    assert not warming.is_alive()
