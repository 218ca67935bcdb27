"""Ray holds nothing it was not asked to hold: on a simulated cluster joined by its address, every CPU is free after
a call that returned, failed, was interrupted or timed out; spares only when asked; what is kept is listed."""

from __future__ import annotations

import _thread
import re
import signal
import sys

import cloudpickle
import pytest
import ray_cluster
from faults_common import Recorder

from air_magic import distributed, ray_init
from air_magic.calls import session_table
from air_magic.job import JobResult, JobStatus
from air_magic.owner import owner

# The ranks run this module's functions: they travel by value (a node cannot import the test module).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("runs_dir")]


@pytest.fixture
def joined(cluster):
    """The shared cluster, which this process joined by its address, with ray_init's defaults for such a cluster
    (whatever an earlier test set); spares off again after the test, as the shared cluster has them."""
    ray_init()
    yield cluster
    ray_init(spares=False)


def nothing_held() -> None:
    """Nothing kept for a later call, no actor alive, and Ray reports every CPU of the cluster free."""
    assert owner().launchers.ray.spare_sets() == [] and owner().launchers.ray.hot_worlds() == []
    ray_cluster.wait_all_free()
    from ray._private.state import actors

    left = [a for a in actors().values() if a["State"] != "DEAD"]
    assert not left, f"actors left alive: {left}"


class WhenAll(Recorder):
    """Records like Recorder; once every rank's output has `marker`, runs `action` once (in the runner's thread)."""

    def __init__(self, marker: str, action) -> None:
        super().__init__()
        self.marker, self.action, self.fired = marker, action, False

    def poll(self) -> None:
        if not self.fired and all(self.marker in self.output(r) for r in range(self.ctx.spec.world_size)):
            self.fired = True
            self.action(self)


def run(func, *, listener=None, **settings) -> JobResult:
    spec = distributed(1, accelerator_type="CPU", num_nodes=2, mlflow=False, **settings)(func)
    return owner().submit(spec.settings.spec(func, (), {}, func.__name__), listeners=[listener or Recorder()])


# -- the functions the ranks run ---------------------------------------------------
def returns():
    import os

    return int(os.environ["RANK"])


def raises_on_rank_1():
    import os
    import time

    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses")
    time.sleep(600)


def hangs():
    import time

    print("READY", flush=True)
    time.sleep(600)


# -- tests ---------------------------------------------------------------------------
def test_a_call_that_returned_leaves_every_cpu_free(joined):
    """A call that returns on a joined cluster keeps no actor and no spare set: every CPU is free."""
    assert run(returns).raise_for_status().values == [0, 1]
    nothing_held()


def test_a_call_that_failed_leaves_every_cpu_free(joined):
    """A rank raises, its peer is stopped: no actor, no spare set, every CPU free."""
    result = run(raises_on_rank_1)
    assert result.status == JobStatus.FAILED and "rank one refuses" in str(result.error)
    nothing_held()


@pytest.fixture
def ctrl_c_live():
    """Ctrl-C raises KeyboardInterrupt in this process, as in a notebook's kernel. A test process started with SIGINT
    ignored (a background job of a non-interactive shell: `make test &`) keeps it ignored, and then
    `_thread.interrupt_main()` does nothing at all, so the call would run to its end."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_call_that_was_interrupted_leaves_every_cpu_free(joined, ctrl_c_live):
    """Ctrl-C (KeyboardInterrupt in the notebook's thread) while both ranks run: the call ends KILLED with a
    KeyboardInterrupt, and every CPU is free."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    result = run(hangs, listener=WhenAll("READY", lambda listener: _thread.interrupt_main()))
    assert result.status == JobStatus.KILLED and isinstance(result.error, KeyboardInterrupt)
    nothing_held()


def test_a_call_that_timed_out_leaves_every_cpu_free(joined):
    """The timeout stops the call wherever it is (starting or running): a TimeoutError, every CPU free."""
    result = run(hangs, timeout=15)
    assert result.status == JobStatus.KILLED and isinstance(result.error, TimeoutError)
    nothing_held()


def test_spares_are_off_on_a_joined_cluster_and_on_when_asked_and_listed(joined):
    """By default a joined cluster gets no spare set; with spares=True a call leaves one, which %distributed_session
    lists (nodes, CPUs, idle time, time left) until release, and turning spares back to the default ends them."""
    run(returns).raise_for_status()
    assert owner().launchers.ray.spare_sets() == []
    ray_init(spares=True)
    run(returns).raise_for_status()
    assert len(owner().launchers.ray.spare_sets()) == 1
    listing = session_table.table(owner().sessions, owner().launchers)
    assert re.search(r"Ray spare actors: 2 node\(s\) with 1 CPU each; idle \d+ s, ends after \d+ s more idle", listing)
    ray_init()  # the default again: off on this cluster, and the spare set kept now ends
    assert owner().launchers.ray.spare_sets() == []
    assert "Ray spare actors" not in session_table.table(owner().sessions, owner().launchers)
    nothing_held()


def test_hot_ranks_are_listed_until_release(joined):
    """keep_alive: the hot ranks are listed with what they hold and when they end; release frees every CPU."""
    run(returns, keep_alive=120).raise_for_status()
    listing = session_table.table(owner().sessions, owner().launchers)
    assert re.search(r"Ray hot ranks: 2 node\(s\) with 1 CPU each; idle \d+ s, ends after \d+ s more idle", listing)
    owner().launchers.ray.release_hot()
    assert "Ray hot ranks" not in session_table.table(owner().sessions, owner().launchers)
    nothing_held()
