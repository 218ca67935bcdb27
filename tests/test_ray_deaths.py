"""A rank's Ray actor whose worker process dies as it starts, on the simulated cluster: started again once, then an
error that says the dead worker's pid, node and exit and quotes the end of its own log."""

from __future__ import annotations

import re
import sys

import cloudpickle
import pytest
import ray_cluster
from faults_common import Recorder

from air_magic import distributed
from air_magic.errors import AirMagicError
from air_magic.launch.ray import packages
from air_magic.launch.ray.starting import RESTARTED
from air_magic.owner import owner

# The ranks would run this module's functions: they travel by value (a node cannot import the test module).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("runs_dir")]

#: What a rank's worker process writes to its stderr (with its pid) just before it ends itself as it starts.
MARKER = "air-magic test: this Ray worker ends itself as it starts"

#: A module whose import ends the process: the actors preload it (AIR_MAGIC_PRELOAD) as their worker starts.
DIES_AT_IMPORT = f"""
import os, sys
print("{MARKER}, pid", os.getpid(), file=sys.stderr, flush=True)
os._exit(3)
"""


#: How the error of a worker that never answered, even once started again, begins (deaths.py).
NEVER_ANSWERED = (
    "a rank's Ray worker process died before any code of the call ran, again after it was started once more"
)


def never_runs():
    return "ran"


def test_a_worker_that_dies_as_it_starts_twice_is_said_with_its_pid_exit_and_log(cluster, tmp_path, monkeypatch):
    """Every rank's worker process prints a marker to its stderr and exits as its actor starts (before any code of
    the call): each rank is started again once, then the call fails with the error of a worker that never answered,
    which names the dead worker's pid on node 127.0.0.1 and quotes the marker from that worker's own log."""
    (tmp_path / "dies_at_import.py").write_text(DIES_AT_IMPORT)
    # the actors' runtime environment: a PYTHONPATH where their workers find the module (instead of any packages)
    monkeypatch.setattr(packages, "prepare", lambda ray, bundle, probe: {"env_vars": {"PYTHONPATH": str(tmp_path)}})
    monkeypatch.setenv("AIR_MAGIC_PRELOAD", "dies_at_import")
    rec = Recorder()
    spec = distributed(1, accelerator_type="CPU", num_nodes=2, mlflow=False)(never_runs)
    result = owner().submit(spec.settings.spec(never_runs, (), {}, "never_runs"), listeners=[rec])
    said = str(result.error)
    assert isinstance(result.error, AirMagicError), said
    assert f"could not run the job: {NEVER_ANSWERED}" in said, said
    assert [RESTARTED in rec.output(rank) for rank in range(2)] == [True, True]
    printed = re.search(rf"\n    {re.escape(MARKER)}, pid (\d+)\n", said)
    assert printed, said
    pid = printed.group(1)
    assert f"The dead worker process: pid {pid} on node 127.0.0.1" in said
    assert re.search(rf"Its log \S+/logs/(old/)?worker-[0-9a-f]+-[0-9a-f]+-{pid}\.err ends:\n", said), said
    ray_cluster.wait_all_free()  # the dead actors' placement group is gone
