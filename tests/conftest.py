"""Fixtures: a real Jupyter kernel per module, private run directories, and a process-leak check."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
from helpers import Kernel, kernel_env, leftover_processes

os.environ.setdefault("MLFLOW_TRACKING_URI", "")  # tests that want MLflow set their own store
# The CPU path, whatever GPUs this machine has: `@distributed(2)` in a test means two gloo workers, on a
# laptop, a one-GPU workstation or an 8-GPU node alike. Tests of the GPU path (marked `gpu`) give their
# kernels helpers.REAL_NODE, which lets air_magic see the node's real GPUs again.
os.environ["AIR_MAGIC_FORCE_CPU"] = "1"

# Fixtures kept next to what they serve, registered once for every module: `lab` (a JupyterLab server,
# tests/lab.py), `s3` (an S3 API on 127.0.0.1, tests/s3_server.py) and `cluster` (the simulated Ray cluster the Ray
# tests of a pytest process share, tests/ray_cluster.py; it also keeps every Ray process on 127.0.0.1).
pytest_plugins = ("lab", "s3_server", "ray_cluster")

#: Fixtures that start a kernel, a server, a cluster or worker processes: a test that uses one (directly or through
#: another fixture) is a behaviour test and must be marked `slow`, so that `make check` (-m "not slow") stays quick.
STARTS_PROCESSES = ("kernel", "cluster", "lab", "s3", "here_runs", "demo_dir")


#: The modules that take longest alone (measured on the 2-core machine), longest first. `make test` hands whole
#: modules to its workers (--dist loadfile --no-loadscope-reorder, scheduled by `pytest_xdist_make_scheduler`) in
#: collection order, so these start first and no long module is left to run alone at the end; the others follow in
#: their usual order. The Ray modules come first, each group of ray_cluster.RAY_GROUPS together: one worker each.
LONGEST_FIRST = (
    "test_ray.py",
    "test_ray_holds.py",
    "test_cli_ray.py",
    "test_code_travels.py",
    "test_ray_sessions.py",
    "test_restarts.py",
    "test_mlflow_speed.py",
    "test_demos.py",
    "test_demos_sharded.py",  # two DeepSpeed calls (its CPU communication op is built by make's install step)
    "test_tracking.py",
    "test_cli_mlflow_ui.py",
    "test_hang.py",
    "test_cli.py",
    "test_browser.py",
    "test_frameworks.py",
    "test_core.py",
    "test_panel.py",
    "test_sessions.py",
    "test_faults_kernels.py",
    "test_mlflow_link_browser.py",
    "test_faults.py",
    "test_cli_attached_debug.py",
    "test_background.py",
    "test_watch.py",
    "test_demos_ddp.py",
    "test_hot.py",
)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadfile, with each group of Ray modules (ray_cluster.RAY_GROUPS) one unit of work: its modules run one
    after another on one worker, which starts one cluster for them all."""
    if config.getvalue("dist") != "loadfile":
        return None
    from ray_cluster import RAY_GROUPS
    from xdist.scheduler import LoadFileScheduling

    class RayGroupsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return RAY_GROUPS.get(Path(path).name, path)

    return RayGroupsTogether(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse a test that starts processes without the `slow` mark; collect the longest modules first (a test's
    place within its module is kept)."""
    unmarked = unmarked_slow(items)
    if unmarked:
        raise pytest.UsageError(
            "these tests start a kernel, a server, a cluster or processes; mark them @pytest.mark.slow: "
            + ", ".join(unmarked)
        )
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def unmarked_slow(items: list[pytest.Item]) -> list[str]:
    """The ids of the tests that use a fixture of STARTS_PROCESSES (or one built on it) but are not marked `slow`."""
    return [
        item.nodeid
        for item in items
        if item.get_closest_marker("slow") is None and set(STARTS_PROCESSES) & set(getattr(item, "fixturenames", ()))
    ]


#: The first failure of each test that `--reruns 1` ran again, kept for the summary: a rerun that passed is still a
#: fault to chase, and its log is the only record CI keeps.
_RERUNS: list[pytest.TestReport] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "rerun":
        _RERUNS.append(report)


def pytest_terminal_summary(terminalreporter) -> None:
    """After pytest-rerunfailures' list of reruns, the error each rerun first failed with (its last 60 lines)."""
    for report in _RERUNS:
        terminalreporter.write_sep("-", f"why {report.nodeid} was run again ({report.when})")
        terminalreporter.write_line("\n".join(report.longreprtext.splitlines()[-60:]))


@pytest.fixture(scope="module")
def loaded_kernel(kernel):
    """The module's kernel with air_magic loaded."""
    kernel.execute("%load_ext air_magic").check()
    return kernel


@pytest.fixture
def releases_hot_ranks(loaded_kernel):
    """The test ends with its hot ranks and sessions gone (the leak check would see them otherwise)."""
    yield
    loaded_kernel.execute("%distributed_release")


@pytest.fixture(autouse=True)
def no_leftover_processes(request):
    """Fail any test that leaves a worker, a worker's child, or an orphaned supervisor behind."""
    before = {p.pid for p in psutil.process_iter()}
    yield
    keep = getattr(request.node, "keep_supervisors", set())
    left = leftover_processes(before, allowed=lambda p: p.pid in keep or _live_supervisor(p))
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not left, f"processes left behind: {[_describe(p) for p in left]}"


def _describe(proc: psutil.Process) -> tuple:
    try:
        env = proc.environ()
        return (
            proc.pid,
            proc.cmdline()[:3],
            proc.status(),
            proc.ppid(),
            {k: v for k, v in env.items() if k.startswith("AIR_MAGIC")},
        )
    except psutil.Error as exc:
        return (proc.pid, repr(exc))


def _live_supervisor(proc: psutil.Process) -> bool:
    """A kernel's supervisor (and its local MLflow UI) is meant to outlive a test while its kernel lives."""
    try:
        cmd = " ".join(proc.cmdline())
        return (
            ("air_magic.launch.local.supervisor" in cmd or "air_magic.tracking.ui" in cmd)
            and proc.ppid() != 1
            and psutil.pid_exists(proc.ppid())
        )
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nb")
    (path / "runs").mkdir()
    return path


def _nothing() -> int:
    return 0


@pytest.fixture(scope="module")
def here_runs(tmp_path_factory):
    """Runs started from the test process keep their directories under pytest's temporary directory for this
    module, and that process's supervisor is started before the first test (so no leak check waits on it)."""
    from faults_common import run_here

    root = tmp_path_factory.mktemp("here-runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIR_MAGIC_RUNS_DIR", str(root))
        run_here(_nothing, num_accelerators=1)
        yield root


@pytest.fixture(scope="module")
def fault_kernel(kernel):
    """The module's kernel with faults_common.FAULT_SETUP run (`timed`, `report`) and its supervisor started before
    the first test, so its leak check does not wait on it."""
    from faults_common import FAULT_SETUP

    kernel.execute(FAULT_SETUP).check()
    kernel.execute("distributed(2, mlflow=False)(lambda: 0).distributed()").check()
    return kernel


@pytest.fixture
def demo_dir(tmp_path: Path) -> Path:
    """A private working directory for one demo notebook, with its runs/ directory."""
    (tmp_path / "runs").mkdir()
    return tmp_path


@pytest.fixture(scope="module")
def kernel(workdir, request):
    """A real ipykernel shared by the tests of one module, with air_magic importable.

    A module's `KERNEL_ENV` (a dict) is added to the kernel's environment: GPU tests pass helpers.REAL_NODE.
    """
    extra = getattr(request.module, "KERNEL_ENV", {})
    k = Kernel(workdir, env=kernel_env(workdir, **extra))
    yield k
    k.shutdown()
