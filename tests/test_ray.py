"""Beyond one node: the same call on a simulated Ray cluster (a head and two 2-CPU nodes, all on 127.0.0.1)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import cloudpickle
import pytest
import ray
import ray_cluster
from faults_common import Recorder, alive
from helpers import ROOT, process_env

from air_magic import JobCancelledError, WorkerDiedError, distributed, ray_init
from air_magic.errors import AirMagicError, RemoteTraceback
from air_magic.job import JobResult, JobStatus, RankState
from air_magic.owner import owner

# The ranks run this module's functions: they travel by value (a node cannot import the test module).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("runs_dir")


@pytest.fixture(autouse=True)
def all_free_after(request):
    """Every test that used the cluster leaves all its CPUs free (the actors and the placement group gone)."""
    yield
    if "cluster" in request.fixturenames:
        ray_cluster.wait_all_free()
        from ray._private.state import actors

        left = [a for a in actors().values() if a["State"] != "DEAD"]
        assert not left, f"actors left alive: {left}"


class WhenAll(Recorder):
    """Records like Recorder; once every rank's output matches `pattern` (a regex), runs `action` (from the
    runner's thread). Output arrives in pieces of any size: a pattern that needs a value must include its line's end."""

    def __init__(self, pattern: str, action) -> None:
        super().__init__()
        self.pattern, self.action, self.fired_at = pattern, action, None

    def poll(self) -> None:
        ranks = self.ctx.spec.world_size
        if self.fired_at is None and all(re.search(self.pattern, self.output(r)) for r in range(ranks)):
            self.fired_at = time.monotonic()
            self.action(self)


def run(func, *, listener=None, nodes: int = 2, per_node: int = 1, **settings) -> JobResult:
    spec = distributed(per_node, accelerator_type="CPU", num_nodes=nodes, mlflow=False, **settings)(func)
    return owner().submit(spec.settings.spec(func, (), {}, func.__name__), listeners=[listener or Recorder()])


# -- the functions the ranks run ---------------------------------------------------
def all_reduce():
    import os

    import ray
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} says hello", flush=True)
    names = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {
        "sum": t.item(),
        "node": ray.get_runtime_context().get_node_id(),
        "env": {k: os.environ[k] for k in names},
    }


def raises_on_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses")
    import time

    time.sleep(600)


def hangs_with_a_child():
    import os
    import subprocess
    import time

    child = subprocess.Popen(["sleep", "600"])
    print(f"PIDS {os.getpid()} {child.pid}", flush=True)
    print("READY", flush=True)
    time.sleep(600)


def hangs():
    import time

    print("READY", flush=True)
    time.sleep(600)


def profiled_steps():
    """8 steps of an all-reduce, each rank multiplying a matrix once; rank 1 also spends 0.3 s a step outside the
    collective (a sleep: on a CPU, what is not a collective or input is compute), more than a busy machine's
    scheduler can make the ranks' matrix products differ by (30 products more on rank 1 were not, on two cores
    shared with three other test workers)."""
    import time

    import torch
    import torch.distributed as dist

    import air_magic

    dist.init_process_group("gloo")
    x, t = torch.randn(128, 128), torch.ones(1024)
    for _ in range(8):
        x @ x
        if dist.get_rank() == 1:
            time.sleep(0.3)
        dist.all_reduce(t)
        air_magic.step()
    return dist.get_rank()


# -- tests ---------------------------------------------------------------------------
@pytest.mark.slow
def test_four_ranks_all_reduce_over_two_nodes(cluster):
    """2 nodes x 2 ranks: gloo all-reduce works unchanged, ranks are ordered by node then local rank, and each
    rank's output is live in the listener and kept in the run directory here."""
    rec = Recorder()
    result = run(all_reduce, listener=rec, per_node=2).raise_for_status()
    values = result.values
    assert [v["sum"] for v in values] == [10.0] * 4
    nodes = [v["node"] for v in values]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    workers = {n.node_id for n in cluster.worker_nodes}
    assert set(nodes) == workers
    for rank, v in enumerate(values):
        env = v["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank % 2) and env["NODE_RANK"] == str(rank // 2)
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == values[0]["env"]["MASTER_PORT"]
        line = f"rank {rank} of 4 says hello"
        assert line in rec.output(rank)
        assert line in (result.run_dir / f"rank-{rank}.log").read_text()
        assert rec.states[rank][-1] == RankState.DONE
    assert list(result.run_dir.glob("*.reserved")) == [], "the room set aside for error records is given back"


@pytest.mark.slow
def test_a_profile_of_ranks_on_two_nodes_comes_back_whole(cluster):
    """profile=3 over two nodes (with the watch, whose steps it counts): each rank's trace and window travel back from
    its node with its result, and the Profile holds both ranks, rank 1 the slowest by its compute, with a merged
    trace of both."""
    import json

    from air_magic.profiling.listener import Profiler
    from air_magic.watching.listener import Watcher

    spec = distributed(1, accelerator_type="CPU", num_nodes=2, mlflow=False, profile=3)(profiled_steps)
    job = spec.settings.spec(profiled_steps, (), {}, "profiled_steps")
    result = owner().submit(job, listeners=[Watcher(job), Profiler(job), Recorder()]).raise_for_status()
    profile = result.profile
    assert profile is not None and [int(r["rank"]) for r in profile.ranks] == [0, 1], result.run_dir
    assert profile.slowest == (1, "compute"), profile.table()
    assert profile.traces == [result.run_dir / "rank-0.trace.json", result.run_dir / "rank-1.trace.json"]
    merged = json.loads(profile.trace.read_bytes())["traceEvents"]  # type: ignore[union-attr]
    assert {e["pid"] for e in merged if "ts" in e} >= {0, 1}


@pytest.mark.slow
def test_a_rank_that_raises_gives_its_exception_and_stops_the_others(cluster):
    """The original exception type, the rank in its note and the remote traceback; the hanging peer is stopped."""
    result = run(raises_on_rank_1)
    assert result.status == JobStatus.FAILED
    assert isinstance(result.error, ValueError) and "rank one refuses" in str(result.error)
    assert "raised on rank 1 of 2" in result.error.__notes__[0]
    assert isinstance(result.error.__cause__, RemoteTraceback)
    assert "raises_on_rank_1" in result.error.__cause__.text
    assert [r.state for r in result.ranks] == [RankState.STOPPED, RankState.FAILED]


@pytest.mark.slow
def test_cancel_while_ranks_hang_stops_them_and_what_they_started(cluster):
    """Cancel ends every rank and its child processes, kills the actors and frees the placement group."""
    rec = WhenAll("READY", lambda listener: listener.ctx.cancel())
    result = run(hangs_with_a_child, listener=rec)
    assert result.status == JobStatus.KILLED and isinstance(result.error, JobCancelledError)
    pids = [int(p) for r in range(2) for p in re.findall(r"PIDS ([0-9 ]+)", rec.output(r))[0].split()]
    assert len(pids) == 4
    deadline = time.monotonic() + 10
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(pids) == []


@pytest.mark.slow
def test_timeout_stops_the_ranks(cluster):
    """The timeout reaches ranks on other nodes too: a DistributedTimeoutError, every actor gone."""
    result = run(hangs, timeout=10)
    assert result.status == JobStatus.KILLED and isinstance(result.error, TimeoutError)
    assert "timeout of 10 s" in str(result.error)


@pytest.mark.slow
def test_a_request_the_cluster_cannot_hold_fails_at_once_saying_what_is_free(cluster):
    """3 nodes asked of a cluster with 2 that have CPUs: an error naming what was asked and what is free."""
    result = run(hangs, nodes=3)
    assert isinstance(result.error, AirMagicError)
    message = str(result.error)
    assert "asked for 3 node(s) with 1 CPU each" in message and "Free now:" in message, message


#: The line a rank of `prints_node_and_hangs` prints, whole (its output may arrive cut anywhere).
NODE_LINE = r"NODE (\w+)\n"


@pytest.mark.slow
def test_a_node_removed_mid_run_is_a_clear_error(cluster):
    """Rank 1's node leaves the cluster while the ranks run: WorkerDiedError naming the rank and its node."""
    removed = {}

    def remove_rank_1_node(listener):
        node_id = re.search(NODE_LINE, listener.output(1)).group(1)
        removed["node"] = node_id
        cluster.remove_node(ray_cluster.node_of(cluster, node_id), allow_graceful=False)

    rec = WhenAll(NODE_LINE, remove_rank_1_node)
    try:
        result = run(prints_node_and_hangs, listener=rec)
        assert removed, "rank 1's node was never removed"
        assert isinstance(result.error, WorkerDiedError), repr(result.error)
        assert "rank 1 was lost" in str(result.error) and "left the Ray cluster" in str(result.error)
    finally:
        ray_cluster.add_node(cluster)  # the next tests have two worker nodes again


def prints_node_and_hangs():
    import time

    import ray

    print("NODE", ray.get_runtime_context().get_node_id(), flush=True)
    time.sleep(600)


# -- hot ranks on Ray ------------------------------------------------------------------
def hot_rank_state():
    """This rank's process, its default process group, and how many calls this process has run."""
    import os
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    calls = sys.modules.setdefault("hot_rank_calls", type(sys)("hot_rank_calls"))
    calls.n = getattr(calls, "n", 0) + 1
    group = id(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()
    return {"pid": os.getpid(), "group": group, "calls": calls.n, "sum": t.item()}


def hot_fails_on_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses")
    return os.getpid()


def wait_gone(pids: list[int], limit: float = 30.0) -> list[int]:
    deadline = time.monotonic() + limit
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


@pytest.mark.slow
def test_hot_calls_run_in_the_same_actors_and_process_group_and_release_frees_every_cpu(cluster):
    """keep_alive over 2 nodes: the second call runs in the same actor processes, with the same default process
    group and what the first call left imported; release ends them and Ray reports every CPU free."""
    first = run(hot_rank_state, keep_alive=120).raise_for_status().values
    second = run(hot_rank_state, keep_alive=120).raise_for_status().values
    assert [v["sum"] for v in first + second] == [2.0] * 4
    assert [v["pid"] for v in second] == [v["pid"] for v in first]
    assert [v["group"] for v in second] == [v["group"] for v in first]
    assert [v["calls"] for v in first] == [1, 1] and [v["calls"] for v in second] == [2, 2]
    assert len(owner().launchers.ray.hot_worlds()) == 1
    owner().launchers.ray.release_hot()
    assert owner().launchers.ray.hot_worlds() == []
    ray_cluster.wait_all_free()
    assert wait_gone([v["pid"] for v in first]) == []


@pytest.mark.slow
def test_hot_ranks_idle_past_keep_alive_end_and_free_their_cpus(cluster):
    """keep_alive=5: five seconds after the call the actors are gone and Ray reports every CPU free."""
    pids = [v["pid"] for v in run(hot_rank_state, keep_alive=5).raise_for_status().values]
    assert len(owner().launchers.ray.hot_worlds()) == 1
    assert wait_gone(pids) == []
    assert owner().launchers.ray.hot_worlds() == []
    ray_cluster.wait_all_free()


@pytest.mark.slow
def test_a_failed_hot_call_ends_the_hot_actors_and_the_next_call_gets_fresh_ones(cluster):
    """A rank that raises in a hot world: its exception, every actor of the world gone; the next call new pids."""
    pids = [v["pid"] for v in run(hot_rank_state, keep_alive=120).raise_for_status().values]
    failed = run(hot_fails_on_rank_1, keep_alive=120)
    assert isinstance(failed.error, ValueError) and "rank one refuses" in str(failed.error)
    assert owner().launchers.ray.hot_worlds() == []
    assert wait_gone(pids) == []
    fresh = run(hot_rank_state, keep_alive=120).raise_for_status().values
    assert [v["calls"] for v in fresh] == [1, 1] and not set(pids) & {v["pid"] for v in fresh}
    owner().launchers.ray.release_hot()


@pytest.mark.slow
def test_a_call_that_needs_what_idle_hot_ranks_hold_ends_them(cluster):
    """Idle hot ranks hold one CPU of each node; a call of another world that needs both runs, and they end."""
    pids = [v["pid"] for v in run(hot_rank_state, keep_alive=120).raise_for_status().values]
    result = run(all_reduce, per_node=2).raise_for_status()
    assert [v["sum"] for v in result.values] == [10.0] * 4
    assert owner().launchers.ray.hot_worlds() == []
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_a_lost_node_of_hot_ranks_gives_fresh_ranks_on_the_next_call(cluster):
    """Rank 1's node leaves while the hot ranks idle: the next call says so and runs in fresh ranks."""
    values = run(hot_rank_state, keep_alive=120).raise_for_status().values
    node_id = owner().launchers.ray.hot_worlds()[0].places[1].node_id
    cluster.remove_node(ray_cluster.node_of(cluster, node_id), allow_graceful=False)
    try:
        deadline = time.monotonic() + 60
        while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, "the removed node is still reported alive"
            time.sleep(0.5)
    finally:
        ray_cluster.add_node(cluster)
    rec = Recorder()
    again = run(hot_rank_state, listener=rec, keep_alive=120).raise_for_status().values
    assert "the hot ranks of this world were lost" in rec.output(0) and "left the Ray cluster" in rec.output(0)
    assert [v["calls"] for v in again] == [1, 1] and values[1]["pid"] != again[1]["pid"]
    owner().launchers.ray.release_hot()


def spare_state():
    """This rank's process, and whether it holds anything of an earlier call (a module, a process group)."""
    import os
    import sys

    import torch.distributed as dist

    held = {"module": "spare_call_marker" in sys.modules, "group": dist.is_initialized()}
    sys.modules["spare_call_marker"] = type(sys)("spare_call_marker")
    dist.init_process_group("gloo")
    dist.destroy_process_group()
    return {"pid": os.getpid(), **held}


def spare_places():
    """Where each actor of the one spare set kept now runs (waiting until they are up)."""
    (spare,) = owner().launchers.ray.spare_sets()
    return ray.get([a.where.remote() for a in spare.actors], timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 60 s quiet; three calls and two spare sets of actors took over 300 s with both cores busy
def test_a_cold_call_runs_in_the_spare_actors_started_after_the_last_one(cluster):
    """With spares on, a cold call leaves a spare set of its shape; the next cold call runs in those processes, which
    hold nothing of an earlier call, and leaves a new set; a spare set whose node left is not used (the call
    places anew and succeeds); a call of another shape that needs what a spare set holds ends it; release ends
    the spares and Ray reports every CPU free."""
    ray_init(spares=True)
    try:
        first = [v["pid"] for v in run(spare_state).raise_for_status().values]
        spare = [pl.pid for pl in spare_places()]
        second = run(spare_state).raise_for_status().values
        assert [v["pid"] for v in second] == spare and not set(spare) & set(first)
        assert not any(v["module"] or v["group"] for v in second), second
        lost = spare_places()
        assert {pl.pid for pl in lost}.isdisjoint(spare)
        cluster.remove_node(ray_cluster.node_of(cluster, lost[1].node_id), allow_graceful=False)
        try:
            deadline = time.monotonic() + 60
            while any(n["NodeID"] == lost[1].node_id and n["Alive"] for n in ray.nodes()):
                assert time.monotonic() < deadline, "the removed node is still reported alive"
                time.sleep(0.5)
        finally:
            ray_cluster.add_node(cluster)
        third = run(spare_state).raise_for_status().values
        assert {v["pid"] for v in third}.isdisjoint(pl.pid for pl in lost)
        held = [pl.pid for pl in spare_places()]
        assert [v["sum"] for v in run(all_reduce, per_node=2).raise_for_status().values] == [10.0] * 4
        assert wait_gone(held) == []
        owner().launchers.ray.release_hot()
        assert owner().launchers.ray.spare_sets() == []
        ray_cluster.wait_all_free()
    finally:
        ray_init(spares=False)


@pytest.mark.slow
def test_a_module_the_notebook_imported_travels_by_value_to_ray_and_local_ranks(cluster, tmp_path):
    """A module imported from a directory of the notebook's, then deleted: Ray ranks and local ranks run the
    notebook's copy (they could not import it by name)."""
    name = f"nb_helpers_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("def version():\n    return 'the notebook copy'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        helpers = __import__(name)
    finally:
        sys.path.remove(str(tmp_path))
    (tmp_path / f"{name}.py").unlink()

    def uses_helpers():
        return helpers.version()

    assert run(uses_helpers).raise_for_status().values == ["the notebook copy"] * 2
    local = distributed(2, accelerator_type="CPU", mlflow=False)(uses_helpers)
    result = owner().submit(local.settings.spec(uses_helpers, (), {}, "uses_helpers"), listeners=[Recorder()])
    assert result.raise_for_status().values == ["the notebook copy"] * 2
    del sys.modules[name]


@pytest.mark.slow
def test_more_than_one_node_without_ray_says_to_call_ray_init(tmp_path):
    """In a notebook that has not joined a cluster, num_nodes=2 is a ConfigurationError that names ray_init;
    num_nodes=1 never imports Ray."""
    code = (
        "import sys\n"
        "from air_magic import distributed, ConfigurationError\n"
        "f = distributed(1, accelerator_type='CPU', num_nodes=2, mlflow=False)(print)\n"
        "try:\n"
        "    f.distributed()\n"
        "except ConfigurationError as e:\n"
        "    print('ERROR', e)\n"
        "g = distributed(1, accelerator_type='CPU', mlflow=False)(print)\n"
        "print('RAY IMPORTED', 'ray' in sys.modules)\n"
    )
    env = process_env({"AIR_MAGIC_RUNS_DIR": str(tmp_path)})  # adds to PYTHONPATH: packages may come from there
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, check=False, text=True, timeout=120
    )
    assert "ERROR" in out.stdout and "ray_init" in out.stdout, out.stdout + out.stderr
    assert "RAY IMPORTED False" in out.stdout


@pytest.mark.slow
def test_ray_init_starts_ray_on_loopback_only_and_twice_is_harmless(tmp_path):
    """ray_init() with no address: every Ray process listens on 127.0.0.1 only, the dashboard too; the second
    call returns the same context."""
    code = f"""
import sys, psutil
sys.path.insert(0, {str(ROOT / "tests")!r})
import ray_cluster  # noqa: F401 - only for patient_raylets below; its loopback setting is undone here
import os
os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
from air_magic import ray_init
with ray_cluster.patient_raylets():
    ctx = ray_init(num_cpus=1)
assert ray_init() is ctx
import ray
session = ray._private.worker._global_node.get_session_dir_path()
ours = [p for p in psutil.process_iter() if p.pid != os.getpid()]
found = []
for p in ours:
    try:
        if session not in " ".join(p.cmdline()) and p.ppid() != os.getpid():
            continue
        found += [(p.pid, p.name(), c.laddr.ip) for c in p.net_connections("inet") if c.status == "LISTEN"]
    except psutil.Error:
        pass
import ipaddress
def loopback(ip):
    a = ipaddress.ip_address(ip)
    return (getattr(a, "ipv4_mapped", None) or a).is_loopback
print("DASHBOARD", ctx.dashboard_url)
print("LISTENERS", len(found))
print("OTHER", [f for f in found if not loopback(f[2])])
ray.shutdown()
"""
    env = process_env({"AIR_MAGIC_RUNS_DIR": str(tmp_path)})
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, check=False, text=True, timeout=180
    )
    assert "LISTENERS" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "OTHER []" in out.stdout, out.stdout
    assert int(re.search(r"LISTENERS (\d+)", out.stdout).group(1)) >= 3  # the GCS, the raylet, the dashboard at least
    assert "DASHBOARD 127.0.0.1:" in out.stdout or "DASHBOARD http://127.0.0.1:" in out.stdout, out.stdout


@pytest.mark.slow
def test_magic_with_nodes_in_a_kernel_metrics_relayed_and_ctrl_c(cluster, workdir, new_kernel):
    """In a notebook: ray_init joins the cluster, `%%distributed --nodes 2` runs the cell on both nodes, and what
    the ranks log with mlflow.log_metric lands in the call's run in the notebook's local sqlite store; Ctrl-C
    while ranks hang on both nodes is a KeyboardInterrupt that leaves nothing held."""
    store = f"sqlite:///{workdir}/ray-mlflow.db"
    k = new_kernel(
        env={
            "AIR_MAGIC_RUNS_DIR": str(workdir / "runs"),
            "AIR_MAGIC_DISPLAY": "text",
            "MLFLOW_TRACKING_URI": store,
        },
    )
    k.execute(
        f"from air_magic import ray_init\n_ = ray_init({cluster.address!r}, log_to_driver=False)\n%load_ext air_magic"
    ).check()
    out = k.execute(
        "%%distributed --nodes 2 --gpus 1 --accelerator-type CPU --out got\n"
        "import os, ray, mlflow\n"
        "print('on node', os.environ['NODE_RANK'])\n"
        "mlflow.log_metric('node_rank', float(os.environ['NODE_RANK']))\n"
        "ray.get_runtime_context().get_node_id()\n",
        timeout=300,
    ).check()
    assert "[rank 1] on node 1" in out.stdout
    check = k.execute(
        "import mlflow\n"
        "run = mlflow.search_runs(search_all_experiments=True, order_by=['start_time DESC'], "
        "output_format='list')[0]\n"
        "history = mlflow.MlflowClient().get_metric_history(run.info.run_id, 'node_rank')\n"
        "print(len(set(got)), len(got), sorted(m.value for m in history), run.info.status)\n"
    ).check()
    assert check.stdout.strip() == "2 2 [0.0, 1.0] FINISHED", check.stdout
    # Ctrl-C while the ranks hang on both nodes: KeyboardInterrupt, and (all_free_after) nothing left held
    msg_id = k.send(
        "%%distributed --nodes 2 --gpus 1 --accelerator-type CPU --no-mlflow\n"
        "import time\nprint('READY', flush=True)\ntime.sleep(600)\n"
    )
    seen = ""
    deadline = time.monotonic() + 240
    while not ("[rank 0] READY" in seen and "[rank 1] READY" in seen):
        assert time.monotonic() < deadline, seen
        msg = k.kc.get_iopub_msg(timeout=240)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            seen += msg["content"]["text"]
    k.interrupt()
    stopped = k.collect(msg_id, timeout=120)
    assert stopped.ename == "KeyboardInterrupt", stopped.traceback


@pytest.mark.slow
def test_hot_ranks_of_a_kernel_over_two_nodes_end_with_the_kernel(cluster, workdir, new_kernel):
    """`%%distributed --nodes 2 --keep-alive`: the second cell runs in the first cell's actor processes; the kernel's
    exit leaves every CPU of the cluster free and no actor alive."""
    k = new_kernel(env={"AIR_MAGIC_RUNS_DIR": str(workdir / "runs"), "AIR_MAGIC_DISPLAY": "text"})
    k.execute(
        f"from air_magic import ray_init\n_ = ray_init({cluster.address!r}, log_to_driver=False)\n%load_ext air_magic"
    ).check()
    cell = (
        "%%distributed --nodes 2 --gpus 1 --accelerator-type CPU --no-mlflow --keep-alive 600 --out pids\n"
        "import os\nos.getpid()\n"
    )
    k.execute(cell, timeout=300).check()
    k.execute("first = list(pids)").check()
    k.execute(cell, timeout=300).check()
    same = k.execute("print('SAME', pids == first, len(pids))").check()
    assert "SAME True 2" in same.stdout, same.stdout
    k.shutdown()  # before the cluster is checked free (new_kernel then finds it ended)
    ray_cluster.wait_all_free(60)


def test_ports_chosen_for_ray_agents_lie_below_the_ephemeral_range_and_never_repeat():
    """The simulated cluster's agent ports cannot be taken by an outgoing connection before the agent binds them."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = [ray_cluster._free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < ephemeral_low for port in ports), sorted(ports)[-3:]


def hangs_in_two_places():
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")

    def stuck_in_data_loading():
        time.sleep(600)

    def waiting_for_the_slow_rank():
        dist.barrier()

    print("training", flush=True)
    if dist.get_rank() == 0:
        stuck_in_data_loading()
    else:
        waiting_for_the_slow_rank()


@pytest.mark.slow
def test_stacks_of_ray_ranks_on_request_and_in_the_cancel_error(cluster):
    """Ray ranks write their stacks on request without stopping, and Cancel's error names each one's innermost user
    frame."""

    class AskThenCancel(WhenAll):
        def poll(self) -> None:
            super().poll()
            if self.fired_at is not None and all("on request at" in self.output(r) for r in (0, 1)):
                self.ctx.cancel()

    rec = AskThenCancel("training\n", lambda listener: listener.ctx.ask_stacks())
    result = run(hangs_in_two_places, listener=rec, timeout=240)
    assert isinstance(result.error, JobCancelledError), result.error
    message = str(result.error)
    assert "rank 0: in stuck_in_data_loading (" in message and "rank 1: in waiting_for_the_slow_rank (" in message, (
        message
    )
    for rank in (0, 1):
        log = (result.run_dir / f"rank-{rank}.log").read_text()
        assert log.count("air_magic: stacks of pid") >= 2, log  # on request, then before stopping
