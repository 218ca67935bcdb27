"""Sessions on the simulated Ray cluster: what a `--nodes 2` session cell builds stays in its actors."""

from __future__ import annotations

import pytest
import ray_cluster
from helpers import cell_values as values
from helpers import distributed_cell

pytestmark = pytest.mark.slow

#: One CPU rank on each of the cluster's two nodes, no MLflow run.
RAY = "--nodes 2 --gpus 1 --accelerator-type CPU --no-mlflow"


@pytest.fixture(scope="module")
def ray_kernel(cluster, new_module_kernel):
    """A kernel joined to the shared cluster (tests/ray_cluster.py) with air_magic loaded."""
    k = new_module_kernel()
    k.execute(
        f"from air_magic import ray_init\n_ = ray_init({cluster.address!r}, log_to_driver=False)\n%load_ext air_magic"
    ).check()
    yield k
    k.shutdown()  # before the cluster is checked free (new_module_kernel then finds it ended)
    ray_cluster.wait_all_free(60)


@pytest.fixture(autouse=True)
def releases_ray_sessions(ray_kernel):
    """Every test ends with its sessions' actors gone and every CPU of the cluster free."""
    yield
    ray_kernel.execute("%distributed_release")
    ray_cluster.wait_all_free(30)


def cell(kernel, line: str, body: str, timeout: float = 300):
    """A session cell on the cluster (placing actors on a loaded machine takes longer than a local start)."""
    return distributed_cell(kernel, line, body, timeout)


def test_names_survive_from_one_session_cell_to_the_next_over_two_nodes(ray_kernel):
    """A second --nodes 2 session cell reads what the first assigned and imported, in the same actor processes,
    and %distributed_session lists the session with its ranks' pids and nodes."""
    first = cell(
        ray_kernel, f"--session {RAY}", "import os\nrank = int(os.environ['RANK'])\nseen = [rank]\nos.getpid()"
    )
    pids = values(first)
    second = cell(
        ray_kernel, f"--session {RAY}", "seen.append(rank * 10)\n(seen, os.getpid(), os.environ['NODE_RANK'])"
    )
    assert values(second) == [([0, 0], pids[0], "0"), ([1, 10], pids[1], "1")]
    listing = ray_kernel.execute("%distributed_session").check().stdout
    assert "session 'default': 2 CPU rank(s) on 2 nodes" in listing and str(pids[1]) in listing, listing
    assert f"rank 1: pid {pids[1]}, 127.0.0.1, cpu, " in listing and "seen: list" in listing, listing


def test_a_user_error_keeps_the_session_and_a_rank_stuck_in_all_reduce_ends_it(ray_kernel):
    """An error raised on one rank while the other finishes keeps the names; when the other is stuck in a
    collective instead, it does not come back from the interrupt: the session ends, and the next NameError says so."""
    cell(ray_kernel, f"--session err {RAY}", "import os\nrank = int(os.environ['RANK'])\ncount = 1").check()
    on_one = cell(ray_kernel, f"--session err {RAY}", "count += 1\nif rank == 1:\n    raise KeyError('one')")
    assert on_one.ename == "KeyError" and "rank 1" in on_one.traceback
    assert "session 'err' was kept" in on_one.traceback
    assert values(cell(ray_kernel, f"--session err {RAY}", "count")) == [2, 2]
    stuck = cell(
        ray_kernel,
        f"--session err {RAY}",
        "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "if rank == 0:\n    raise RuntimeError('rank 0 fails')\ndist.all_reduce(torch.ones(1))",
    )
    assert stuck.ename == "RuntimeError" and "rank 0 fails" in stuck.traceback
    assert "session 'err' ended" in stuck.traceback and "did not come back" in stuck.traceback
    assert "stacks of pid" in stuck.stdout  # where the stuck rank was, written before the stop
    after = cell(ray_kernel, f"--session err {RAY}", "count")
    assert after.ename == "NameError" and "held 'count'" in after.traceback, after.traceback


def test_an_interrupt_during_a_loop_keeps_what_the_loop_had_done(ray_kernel):
    """The kernel's interrupt in a sleep loop raises KeyboardInterrupt in both actors' code; the names keep the
    loop's progress and the next cell runs in the same processes."""
    pids = values(cell(ray_kernel, f"--session intr {RAY}", "import os, time\nsteps = 0\nos.getpid()"))
    mid = ray_kernel.send(
        f"%%distributed --session intr {RAY}\n"
        "for i in range(6000):\n    steps += 1\n    print('step', steps, flush=True)\n    time.sleep(0.05)"
    )
    out = ray_kernel.collect(
        mid,
        timeout=120,
        interrupt_when=lambda out: "[rank 0] step 5\n" in out.stdout and "[rank 1] step 5\n" in out.stdout,
    )
    assert out.ename == "KeyboardInterrupt", out.traceback
    assert "session 'intr' was kept" in out.traceback
    progress = values(cell(ray_kernel, f"--session intr {RAY}", "(steps, os.getpid())"))
    assert [pid for _, pid in progress] == pids
    assert all(5 <= steps < 6000 for steps, _ in progress), progress


def test_a_function_in_a_ray_session_takes_refs_and_pull_brings_values_back(ray_kernel):
    """@distributed(session=..., num_nodes=2): free globals resolve in the session first, Ref passes each rank its
    own object, %distributed_pull brings a list by rank back, and --ranks 1 runs a cell on rank 1 alone."""
    ray_kernel.execute(
        "from air_magic import Ref, distributed\n"
        "offset = 1000\n"
        "@distributed(1, accelerator_type='CPU', num_nodes=2, mlflow=False, session='fn')\n"
        "def combine(model, scale):\n"
        "    global last\n"
        "    last = model['w'] * scale + offset\n"
        "    return last\n"
    ).check()
    cell(
        ray_kernel, f"--session fn {RAY}", "import os\nmodel = {'w': int(os.environ['RANK']) + 1}\noffset = 10"
    ).check()
    assert values(ray_kernel.execute("combine.distributed(Ref('model'), 2)")) == [12, 14]
    ray_kernel.execute("pulled = %distributed_pull --session fn last").check()
    assert ray_kernel.value("pulled") == "[12, 14]"
    assert values(cell(ray_kernel, f"--session fn --ranks 1 {RAY}", "last += 1\nlast")) == [15]
    assert values(cell(ray_kernel, f"--session fn {RAY}", "last")) == [12, 15]


def test_an_actor_lost_while_the_session_idles_is_said_and_the_next_cell_gets_new_ranks(ray_kernel):
    """Rank 1's actor process dies between cells: the next cell says the session's ranks were lost, its NameError
    names the ranks that held the name, and it runs in new actors."""
    import psutil

    pids = values(cell(ray_kernel, f"--session lost {RAY}", "import os\nweights = [1, 2]\nos.getpid()"))
    psutil.Process(pids[1]).kill()
    psutil.wait_procs([psutil.Process(pids[1])], timeout=15)
    out = cell(ray_kernel, f"--session lost {RAY}", "weights")
    assert out.ename == "NameError" and "held 'weights'" in out.traceback, out.traceback
    assert "session 'lost'" in out.stderr and "its ranks were lost" in out.stderr, out.stderr
    assert "the ranks of session 'lost' were lost" in out.stdout, out.stdout
    fresh = values(cell(ray_kernel, f"--session lost {RAY}", "import os\nos.getpid()"))
    assert not set(fresh) & set(pids)
