"""Fixtures: real Jupyter kernels (one family: `new_kernel` per test, `new_module_kernel` per module, and `kernel`
and `lab_kernel` built on it), private run directories, and a process-leak check."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import psutil
import pytest
from helpers import Kernel, air_magic_cli, kernel_env, leftover_processes, process_env

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
STARTS_PROCESSES = (
    "kernel",
    "lab_kernel",
    "new_kernel",
    "new_module_kernel",
    "cluster",
    "lab",
    "s3",
    "here_runs",
    "demo_dir",
)


#: Seconds each module took alone in the last recorded run (`make test-costs` writes it: `--record-costs`).
#: `make test` hands whole modules to its workers (--dist loadfile --no-loadscope-reorder, scheduled by
#: `pytest_xdist_make_scheduler`) in collection order, costliest first, so no long module is left to run alone at the
#: end; a module not recorded yet goes first (its cost is unknown). The Ray modules of each group of
#: ray_cluster.RAY_GROUPS run together on one worker.
COSTS = Path(__file__).with_name("module_costs.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-costs",
        action="store_true",
        help=f"write each module's time (setup, call and teardown of its tests) to {COSTS.name}",
    )


def module_costs() -> dict[str, float]:
    """Each module's recorded cost in seconds, by file name."""
    try:
        return {str(k): float(v) for k, v in json.loads(COSTS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SPENT[Path(report.nodeid.split("::", 1)[0]).name] = _SPENT.get(
        Path(report.nodeid.split("::", 1)[0]).name, 0.0
    ) + float(report.duration)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With --record-costs, in the controlling process only: every module's time, written for the next run."""
    if session.config.getoption("record_costs") and not hasattr(session.config, "workerinput") and _SPENT:
        costs = {name: round(seconds, 1) for name, seconds in sorted(_SPENT.items(), key=lambda kv: -kv[1])}
        COSTS.write_text(json.dumps(costs, indent=1) + "\n")


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
    """Refuse a test that starts processes without the `slow` mark; collect the costliest modules first (a test's
    place within its module is kept)."""
    unmarked = unmarked_slow(items)
    if unmarked:
        raise pytest.UsageError(
            "these tests start a kernel, a server, a cluster or processes; mark them @pytest.mark.slow: "
            + ", ".join(unmarked)
        )
    costs = module_costs()
    items.sort(key=lambda item: -costs.get(item.path.name, float("inf")))


def unmarked_slow(items: list[pytest.Item]) -> list[str]:
    """The ids of the tests that use a fixture of STARTS_PROCESSES (or one built on it) but are not marked `slow`."""
    return [
        item.nodeid
        for item in items
        if item.get_closest_marker("slow") is None and set(STARTS_PROCESSES) & set(getattr(item, "fixturenames", ()))
    ]


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
def cli(tmp_path_factory, request):
    """`air-magic ARGS` as a user runs it, in a private directory (its own runs root and MLflow store) holding the
    module's `CLI_FILES` ({path: text}): `cli(...)` waits and returns the CompletedProcess, `cli.start(...)` returns
    the running Popen (output in its stdout); `cli.root` and `cli.env` are the directory and environment. A module's
    `KERNEL_ENV` is added to that environment, as to its kernels' (GPU tests pass helpers.REAL_NODE)."""
    root = tmp_path_factory.mktemp("cli")
    (root / "runs").mkdir()
    for name, text in getattr(request.module, "CLI_FILES", {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    env = process_env(kernel_env(root, **getattr(request.module, "KERNEL_ENV", {})))

    def start(*args: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "air_magic.cli", *args]
        return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    run = partial(air_magic_cli, root, env)
    run.root, run.env, run.start = root, env, start  # type: ignore[attr-defined]
    return run


class _Kernels:
    """The one place test kernels start and end: `start(...)` starts a helpers.Kernel and keeps it; `end_all()` shuts
    down every kept kernel that still runs, checking that its children (supervisor, workers, their children) went with
    it, and closes this side of those its test killed, restarted or shut down itself."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[tuple[Kernel, bool]] = []

    def start(
        self,
        env: dict[str, str] | None = None,
        *,
        cwd: Path | None = None,
        display: str | None = None,
        check_children: bool = True,
        **extra: str,
    ) -> Kernel:
        """A real ipykernel started in `cwd` (the module's workdir by default) with `env` (by default
        helpers.kernel_env(cwd): private run directories, plain-text display, a sqlite MLflow store), AIR_MAGIC_DISPLAY
        set to `display` if given, and `extra` added. `check_children=False`: its children may outlive its shutdown."""
        where = self.workdir if cwd is None else Path(cwd)
        full = {**(kernel_env(where) if env is None else env), **extra}
        if display is not None:
            full["AIR_MAGIC_DISPLAY"] = display
        k = Kernel(where, env=full)
        self.started.append((k, check_children))
        return k

    def end_all(self) -> None:
        """End the kept kernels, the last started first; every one is ended even if another's check fails."""
        if not self.started:
            return
        k, check = self.started.pop()
        try:
            _end_kernel(k, check)
        finally:
            self.end_all()


def _end_kernel(k: Kernel, check: bool) -> None:
    """Shut a live kernel down (helpers.Kernel.shutdown: with `check`, its children must go within 15 s, and any left
    are killed); of one already dead (killed, shut down), stop the channels, reap the process and free what is left."""
    if k.km.is_alive():
        k.shutdown(check=check)
        return
    k.kc.stop_channels()
    process = getattr(k.km.provisioner, "process", None)
    if process is not None:
        process.wait()
    k.km.cleanup_resources()


@contextlib.contextmanager
def _kernels(workdir: Path) -> Iterator[Callable[..., Kernel]]:
    kernels = _Kernels(workdir)
    try:
        yield kernels.start
    finally:
        kernels.end_all()


@pytest.fixture
def new_kernel(workdir):
    """`new_kernel(env=None, *, cwd=None, display=None, check_children=True, **extra)`: a real ipykernel for this test
    (see _Kernels.start); at the test's end every one still running is shut down and its children must be gone."""
    with _kernels(workdir) as start:
        yield start


@pytest.fixture(scope="module")
def new_module_kernel(workdir):
    """`new_kernel` for module-scoped fixtures: the kernels it starts end with the module."""
    with _kernels(workdir) as start:
        yield start


@pytest.fixture(scope="module")
def lab_kernel(new_module_kernel, workdir, request):
    """A real ipykernel in its default display mode (the panel), with air_magic importable and the module's
    `LAB_KERNEL_SETUP` (code, if any) run in it first."""
    from widget_state import WidgetMirror, run_cell

    k = new_module_kernel(env={"AIR_MAGIC_RUNS_DIR": str(workdir / "runs")}, display="auto")
    run_cell(k, getattr(request.module, "LAB_KERNEL_SETUP", "pass"), WidgetMirror()).check()
    return k


@pytest.fixture(scope="module")
def kernel(new_module_kernel, request):
    """A real ipykernel shared by the tests of one module, with air_magic importable.

    A module's `KERNEL_ENV` (a dict) is added to the kernel's environment: GPU tests pass helpers.REAL_NODE.
    """
    return new_module_kernel(**getattr(request.module, "KERNEL_ENV", {}))
