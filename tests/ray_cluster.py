"""A simulated Ray cluster on this machine for the tests: a head without CPUs and two 2-CPU nodes, all on 127.0.0.1.

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` must be in the environment before Ray is
imported, in this process and in every process Ray starts: with it, every Ray
process listens on 127.0.0.1 only (on Linux Ray otherwise takes the machine's
network address). The head holds no CPUs, so a job's ranks land on the two
worker nodes, and `num_nodes=2` means those two.

Registered as a pytest plugin (tests/conftest.py): the fixture `cluster` is one such cluster for the Ray tests of a
pytest process, started by the first test that asks for it. The modules that use it fall in two groups
(`RAY_GROUPS`); `make test` runs each group's modules one after another on one of its workers (tests/conftest.py
collects them first and schedules each group as one unit), so at most two clusters run at once, and a cluster ends
as soon as its worker goes on to a module without Ray (not at the end of the whole run, where an idle cluster would
have cost the other workers CPU all along). A test that removes a node adds one back (`add_node`), and one that adds
a node removes it (`remove_node`); after each test that used the cluster, `two_worker_nodes` puts it back to two
worker nodes, so the next test finds the cluster it expects.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import socket
import time

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_enable_metrics_collection", "0")  # the tests read no Ray metrics
# A raylet waits this long for its agents to start (they import for many seconds on a busy machine).
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
# A raylet kills a worker that has not registered 60 s after it started (Ray's default); with both cores busy a
# worker importing ray took longer, and the actor it was for died before it ran ("ActorDiedError ... connection
# error code 2"). The simulated nodes share one small machine: give workers the time they take there.
os.environ.setdefault("RAY_worker_register_timeout_seconds", "300")
# The head checks each node every second instead of every 3 s: a removed node is known dead after about 5 s
# instead of 15 s (the node-loss tests wait for that). A live node under load still has 5 checks of 10 s each.
os.environ.setdefault("RAY_health_check_period_ms", "1000")
# An idle cluster of three nodes took about 0.6 of a core here (18 CPU-seconds in 30 s, measured with psutil): each
# node's dashboard and runtime-env agents poll (their reports every 5 s, the event directory every 2 s, metrics every
# 5 s) and the workers Ray keeps idle after the warm-up tasks poll too. The suite runs two such clusters beside
# the other tests on two cores. With these, the same idle cluster took about 0.26 of a core: the agents look less
# often, and a worker left idle ends after a second (the next task or actor starts one; the tests measure no speed).
for _name, _value in {
    "RAY_num_workers_soft_limit": "0",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "SCAN_EVENT_DIR_INTERVAL_SECONDS": "60",
    "METRICS_RECORD_INTERVAL_S": "60",
}.items():
    os.environ.setdefault(_name, _value)

#: CPUs of each worker node.
NODE_CPUS = 2
#: Worker nodes of the shared cluster at the start of every test.
WORKER_NODES = 2


#: The modules that use the cluster, by group: a group's modules run one after another in one pytest process.
RAY_GROUPS = {  # about even by tests/module_costs.json: 765 s and 764 s
    "test_ray.py": "ray-a",
    "test_ray_holds.py": "ray-a",
    "test_ray_deaths.py": "ray-a",
    "test_cli_ray_command.py": "ray-a",
    "test_code_travels.py": "ray-b",
    "test_ray_sessions.py": "ray-b",
    "test_restarts.py": "ray-b",
    "test_cli_ray.py": "ray-b",
}

#: The cluster of this pytest process while its Ray modules run.
_running: list = []


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """The run directories of a Ray module's calls, private to that module (its `pytestmark` asks for it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path_factory.mktemp("ray-runs")))
        yield


@pytest.fixture(scope="session")
def cluster():
    """The simulated cluster shared by the Ray tests of this pytest process, this process joined to it as a notebook
    would be (spare actors off: the spares' test turns them on). `cluster.address` is what kernels join."""
    from air_magic import ray_init

    c = start_cluster(WORKER_NODES)
    _running.append(c)
    ray_init(c.address, log_to_driver=False, spares=False)
    yield c
    _stop()


def _stop() -> None:
    """End this process's cluster, if it runs (this process leaves it first)."""
    while _running:
        import ray

        ray.shutdown()
        _running.pop().shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A module that uses the cluster but is in no group would start a cluster of its own beside the groups'."""
    strays = sorted({i.path.name for i in items if "cluster" in getattr(i, "fixturenames", ())} - set(RAY_GROUPS))
    if strays:
        raise pytest.UsageError(
            f"these modules use the Ray cluster: add them to RAY_GROUPS in tests/ray_cluster.py: {strays}"
        )


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of this process's Ray modules (the next test's module has no Ray, or none is next), the
    cluster ends: the test's own fixtures were torn down first (trylast)."""
    if _running and (nextitem is None or nextitem.path.name not in RAY_GROUPS):
        _stop()


def pytest_sessionfinish() -> None:
    _stop()


@pytest.fixture(autouse=True)
def two_worker_nodes(request):
    """After a test that used the shared cluster, it has two worker nodes again (one lost by a failed node-loss
    test is added back, one a test added is removed)."""
    if "cluster" not in request.fixturenames:
        yield
        return
    c = request.getfixturevalue("cluster")
    if not _running:
        pytest.fail(f"this process's cluster ended after its Ray modules; keep {request.path.name} in RAY_GROUPS")
    yield
    while len(c.worker_nodes) > WORKER_NODES:
        remove_node(c, list(c.worker_nodes)[-1])
    while len(c.worker_nodes) < WORKER_NODES:
        add_node(c)


@contextlib.contextmanager
def patient_raylets():
    """Let a raylet start on a busy machine: its agents' ports are chosen up front and written where it looks.

    A raylet waits about 15 s for its dashboard agent to write the agent's ports to the session
    directory and aborts after that; on this 2-core machine, shared with other work, the agent can
    take longer just to import. With the ports chosen here and written before the raylet starts,
    it goes on at once; the agents are given those same ports and bind them when they are up.
    """
    import ray._raylet as raylet
    from ray._private import services

    original = services.start_raylet
    signature = inspect.signature(original)

    def start_raylet(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        for name, key in (
            (raylet.METRICS_AGENT_PORT_NAME, "metrics_agent_port"),
            (raylet.METRICS_EXPORT_PORT_NAME, "metrics_export_port"),
            (raylet.DASHBOARD_AGENT_LISTEN_PORT_NAME, "dashboard_agent_listen_port"),
            (raylet.RUNTIME_ENV_AGENT_PORT_NAME, "runtime_env_agent_port"),
        ):
            given[key] = int(given.get(key) or _free_port())
            raylet.persist_port(given["session_dir"], given["node_id"], name, given[key])
        return original(*bound.args, **bound.kwargs)

    services.start_raylet = start_raylet
    try:
        yield
    finally:
        services.start_raylet = original


def start_cluster(nodes: int = 2):
    """Start the cluster and wait until every node has joined."""
    from ray.cluster_utils import Cluster

    with patient_raylets():
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False, **_node_args()},
        )
    for _ in range(nodes):
        add_node(cluster)
    return cluster


def add_node(cluster, wait: bool = True):
    with patient_raylets():
        node = cluster.add_node(num_cpus=NODE_CPUS, wait=wait, **_node_args())
    if wait:
        cluster.wait_for_nodes(timeout=90)
    return node


def remove_node(cluster, node) -> None:
    """Take `node` out of the cluster and wait until Ray no longer counts it alive."""
    import ray

    cluster.remove_node(node)
    deadline = time.monotonic() + 60
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the removed node is still reported alive"
        time.sleep(0.2)


#: Ports handed out by `_free_port` in this process: never the same one twice.
_taken: set[int] = set()


def _free_port() -> int:
    """A port free now and outside the range the kernel takes local ports of connections from.

    An agent binds its port many seconds after the raylet is given it; a port picked by binding
    port 0 lies in the ephemeral range, where any outgoing connection meanwhile may take it (a run
    lost a node that way: "Address already in use", and the raylet fate-shares with its agent).
    Between Ray's own worker ports (10002-19999) and that range, nothing takes a port without
    asking for it.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = 20000, min(ephemeral_low, 32768)
    pick = random.Random()
    for _ in range(2000):
        port = pick.randrange(low, high)
        if port in _taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError(f"no free port between {low} and {high} on 127.0.0.1")


def _node_args() -> dict:
    """Every node on loopback, without a log monitor: it streams workers' output to drivers, and every driver of the
    suite joins with log_to_driver=False (a rank's output reaches the notebook through its own log)."""
    return {"node_ip_address": "127.0.0.1", "include_log_monitor": False}


def node_of(cluster, node_id: str):
    """The cluster_utils node object whose Ray node id is `node_id`."""
    for node in cluster.worker_nodes:
        if node.node_id == node_id:
            return node
    raise LookupError(node_id)


def wait_all_free(timeout: float = 20.0) -> dict:
    """Wait until the cluster reports every CPU and GPU free; return what it reports (fails with the difference)."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        total = ray.cluster_resources()
        free = ray.available_resources()
        busy = {k: (free.get(k, 0), total[k]) for k in ("CPU", "GPU") if k in total and free.get(k, 0) != total[k]}
        if not busy:
            return free
        if time.monotonic() > deadline:
            raise AssertionError(f"resources still held {timeout:g} s after the call (free, total): {busy}")
        time.sleep(0.2)
