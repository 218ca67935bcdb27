"""MLflow at launch speed: what a warm helper preloads, ranks that log get for free and ranks that do not never see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlflow
import psutil
import pytest
from helpers import ROOT, Kernel, run_id_of

# MLflow 3.17's sqlite store uses a SQLAlchemy loader option that SQLAlchemy 2.1 deprecates.
pytestmark = [pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"), pytest.mark.slow]

#: A rank function that imports mlflow and logs one metric per rank, and reports which module files
#: ran meanwhile (Python's "exec" audit event fires for each module body executed on import).
LOGS_AND_COUNTS_IMPORTS = """
def logs_once(key):
    import os, sys
    executed = []
    sys.addaudithook(
        lambda event, args: executed.append(getattr(args[0], "co_filename", "")) if event == "exec" else None
    )
    import mlflow
    mlflow.log_metric(key, float(os.environ["RANK"]))
    return [f for f in executed if f.endswith(".py")]
"""


def supervisor_pids(kernel: Kernel) -> set[int]:
    """The pids of the kernel's helpers (a child that ends while it is looked at is none)."""
    found = set()
    for child in psutil.Process(kernel.pid).children():
        try:
            if "air_magic.launch.local.supervisor" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def test_rank_that_never_logged_builds_no_tracking_store(tmp_path):
    """At a rank's exit, a process that has mlflow loaded but never logged does not open the tracking store."""
    db = tmp_path / "never.db"
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import mlflow
        os.environ.update(MLFLOW_TRACKING_URI="sqlite:///{db}", MLFLOW_RUN_ID="0" * 32)
        os.environ["MLFLOW_ENABLE_ASYNC_LOGGING"] = "true"
        from air_magic.tracking import hook
        hook.flush()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=300)
    assert not db.exists(), "flush() built the tracking store (and created its database) with nothing to send"


@pytest.fixture(scope="module")
def preload_nb(new_module_kernel, workdir):
    """A kernel whose warm helper preloads mlflow at start (AIR_MAGIC_PRELOAD), tracking to a sqlite store."""
    k = new_module_kernel(
        env={
            "AIR_MAGIC_RUNS_DIR": str(workdir / "runs"),
            "AIR_MAGIC_DISPLAY": "text",
            "AIR_MAGIC_PRELOAD": "torch,mlflow",
            "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/preload.db",
        },
    )
    k.execute("from air_magic import distributed" + LOGS_AND_COUNTS_IMPORTS).check()
    return k  # new_module_kernel checks at its end that the supervisor went with the kernel


def test_preloading_mlflow_keeps_one_helper_for_calls_that_do_not_log(preload_nb):
    """With mlflow preloaded and tracking on, calls that do not log and calls that do are all served by the one
    helper."""
    preload_nb.execute(
        "@distributed(num_accelerators=2, accelerator_type='CPU', warm=True)\n"
        "def parent():\n    import os\n    return os.getppid()\n"
        "logs = distributed(num_accelerators=2, accelerator_type='CPU', warm=True)(logs_once)\n"
        "first = parent.distributed()",
        timeout=300,
    ).check()
    helper = supervisor_pids(preload_nb)
    assert len(helper) == 1
    for _ in range(2):
        assert preload_nb.execute("parent.distributed() == first", timeout=300).check().result == "True"
        wait_idle(*helper)  # the helper warms the store up while idle; a call arriving sooner does not wait for it
        out = preload_nb.execute("logs.distributed('x')", timeout=300).check()
        assert out.result == "[[], []]", "mlflow came from the helper: no module file ran in the ranks"
    assert supervisor_pids(preload_nb) == helper, "the helper was never replaced"
    assert preload_nb.execute("parent.distributed() == first").check().result == "True"


#: In a process like the helper (torch imported once): for each interruption point, a forked copy runs the MLflow
#: warm-up interrupted at its `asks`-th chance to give way, then to the end; then a worker forked from that copy
#: imports mlflow (from it) and logs to the store. Prints one exit code per point.
INTERRUPTED_WARM_UP = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
from air_magic.launch.local.preload import Preloaded
uri, points = sys.argv[2], [int(a) for a in sys.argv[3:]]

def helper(asks):
    preloaded = Preloaded(warm=False)
    preloaded.ask(["air_magic.tracking.hook"], {"MLFLOW_TRACKING_URI": uri})
    count = iter(range(1, 1 << 20))
    assert preloaded.run_preparations(lambda hook: next(count) >= asks) is False
    assert preloaded.run_preparations() is True
    pid = os.fork()
    if pid == 0:
        try:
            preloaded.hide_in_child()
            import mlflow
            client = mlflow.MlflowClient(uri)
            run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
            client.log_metric(run.info.run_id, "x", 1.0)
            os._exit(0 if len(client.get_metric_history(run.info.run_id, "x")) == 1 else 3)
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

codes = []
for asks in points:
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(helper(asks))
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(2)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(" ".join(map(str, codes)))
"""

#: Chances to give way at which the warm-up is interrupted: its first module, and points inside mlflow's import.
INTERRUPTIONS = [1, 400, 1350, 1450, 1550, 1650]


@pytest.mark.slow
def test_an_interrupted_mlflow_warm_up_leaves_a_helper_whose_workers_log(tmp_path):
    """Wherever the helper's MLflow warm-up gives way to a call, it later completes, and a worker forked from it
    imports mlflow and logs to the store (no library is left half set up)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.MlflowClient(uri).search_experiments()  # the store exists, as the notebook makes it first
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_WARM_UP, str(ROOT), uri, *map(str, INTERRUPTIONS)],
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    codes = dict(zip(INTERRUPTIONS, map(int, done.stdout.split()[-len(INTERRUPTIONS) :]), strict=True))
    assert codes == dict.fromkeys(INTERRUPTIONS, 0), f"exit code per interruption point: {codes}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def mlflow_kernel(kernel):
    """The shared kernel (tracking to a sqlite store), with the logging function defined."""
    kernel.execute("from air_magic import distributed\nimport mlflow" + LOGS_AND_COUNTS_IMPORTS).check()
    # The import set the store up in the background; the tests' own client opens it only after that.
    kernel.execute("from air_magic.tracking import prepare\nprepare.wait()").check()
    return kernel


def test_later_calls_import_mlflow_from_the_warm_helper_and_log_to_their_run(mlflow_kernel, workdir):
    """After a call with MLflow on, later calls' ranks import mlflow without running any module file, and log to their
    run."""
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    mlflow_kernel.execute(
        "logs = distributed(num_accelerators=2, accelerator_type='CPU', warm=True)(logs_once)"
    ).check()
    first = mlflow_kernel.execute("logs.distributed('loss')", timeout=300).check()
    helper = supervisor_pids(mlflow_kernel)
    for _ in range(2):
        wait_idle(*helper)  # the helper's warm-up runs while it is idle; a call arriving sooner does not wait for it
        out = mlflow_kernel.execute("logs.distributed('loss')", timeout=300).check()
        assert out.result == "[[], []]", f"module files ran in the ranks: {out.result}"
        metrics = client.get_metric_history(run_id_of(out.stdout), "loss")
        assert sorted(m.value for m in metrics) == [0.0, 1.0]
        assert client.get_run(run_id_of(out.stdout)).info.status == "FINISHED"
    assert sorted(m.value for m in client.get_metric_history(run_id_of(first.stdout), "loss")) == [0.0, 1.0]
    assert supervisor_pids(mlflow_kernel) == helper


def test_ranks_that_do_not_import_mlflow_do_not_see_it(mlflow_kernel):
    """Ranks of a warm helper that preloaded mlflow do not have it (or its dependencies) loaded unless their code
    imports it."""
    mlflow_kernel.execute(
        "distributed(num_accelerators=2, accelerator_type='CPU', warm=True)(logs_once).distributed('warm')", timeout=300
    ).check()
    out = mlflow_kernel.execute(
        """
@distributed(num_accelerators=2, accelerator_type='CPU', warm=True)
def untouched():
    import importlib.util, sys
    loaded = [m for m in ("mlflow", "sqlalchemy", "alembic") if m in sys.modules]
    found = importlib.util.find_spec("mlflow") is not None
    still = "mlflow" in sys.modules
    import mlflow.tracking
    return loaded, found, still, mlflow.tracking.__name__, mlflow.__spec__.name
untouched.distributed()
""",
        timeout=300,
    ).check()
    assert eval(out.result) == [([], True, False, "mlflow.tracking", "mlflow")] * 2


def test_set_experiment_in_a_rank_still_warns_with_mlflow_preloaded(mlflow_kernel):
    """The rank-side set_experiment guard still applies when mlflow comes from the warm helper."""
    mlflow_kernel.execute(
        "distributed(num_accelerators=2, accelerator_type='CPU', warm=True)(logs_once).distributed('warm')", timeout=300
    ).check()
    out = mlflow_kernel.execute(
        """
@distributed(num_accelerators=2, accelerator_type='CPU', warm=True)
def stubborn():
    import mlflow
    mlflow.set_experiment("somewhere-else")
    mlflow.log_metric("y", 2.0)
stubborn.distributed()
""",
        timeout=300,
    ).check()
    assert "mlflow.set_experiment('somewhere-else') ignored on rank 1" in out.stdout


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 over its own sqlite store, stopped at the end."""
    from air_magic.tracking import ui as mlflow_ui

    path = tmp_path_factory.mktemp("mlflow-server")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIR_MAGIC_RUNS_DIR", str(path))  # where the server's log goes
        mp.chdir(path)  # and its artifacts (./mlartifacts)
        ui = mlflow_ui.local_ui(f"sqlite:///{path}/server.db", None)
        try:
            mlflow_ui.wait_ready(ui, timeout=240)
            yield ui.direct_url.rstrip("/")
        finally:
            mlflow_ui.shutdown()


def test_ranks_log_through_a_tracking_server_at_warm_speed(server, workdir, new_kernel):
    """With a tracking server, later calls' ranks import mlflow from the helper and every metric reaches the server's
    run."""
    k = new_kernel(
        env={"AIR_MAGIC_RUNS_DIR": str(workdir / "runs"), "AIR_MAGIC_DISPLAY": "text", "MLFLOW_TRACKING_URI": server},
    )
    k.execute("from air_magic import distributed" + LOGS_AND_COUNTS_IMPORTS).check()
    k.execute("""
@distributed(num_accelerators=2, accelerator_type='CPU', warm=True)
def steps(n):
    import os, mlflow
    for i in range(n):  # each rank its own values: MLflow stores a point (key, step, value, ms) logged twice once
        mlflow.log_metric("loss", 1.0 / (i + 1) + int(os.environ["RANK"]), step=i)
    return os.environ["RANK"]
""").check()
    client = mlflow.MlflowClient(server)
    for _ in range(3):
        out = k.execute("steps.distributed(50)", timeout=300).check()
        assert out.result == "['0', '1']"
        assert len(client.get_metric_history(run_id_of(out.stdout), "loss")) == 100
    (helper,) = supervisor_pids(k)
    wait_idle(helper)
    out = k.execute(
        "distributed(num_accelerators=2, accelerator_type='CPU', warm=True)(logs_once).distributed('x')",
        timeout=300,
    ).check()
    assert out.result == "[[], []]"
    assert sorted(m.value for m in client.get_metric_history(run_id_of(out.stdout), "x")) == [0.0, 1.0]


def test_worker_side_modules_import_no_mlflow_ipython_or_widgets():
    """A rank that imports the hook, the chart writer and the worker has no mlflow, IPython or ipywidgets."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        "import air_magic.tracking.hook, air_magic.tracking.tee, air_magic.launch.rank.worker; "
        "print(sorted(m for m in ('mlflow', 'IPython', 'ipywidgets') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def wait_idle(pid: int, timeout: float = 180.0) -> None:
    """Wait until process `pid` has used no CPU for a second (a helper done with its imports)."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    last = -1.0
    while time.monotonic() < deadline:
        used = sum(proc.cpu_times()[:2])
        if used == last:
            return
        last = used
        time.sleep(1.0)
    raise AssertionError(f"process {pid} was still busy after {timeout:g} s")


@pytest.mark.slow
def test_first_and_second_calls_after_loading_the_extension_find_mlflow_ready_in_the_helper(tmp_path, new_kernel):
    """Once the work %load_ext starts in the background is done (the helper's MLflow warm-up included), the first
    and the second call with MLflow on (a fresh default store) are served by that helper, their ranks import mlflow
    without running a module file, and log to their runs (what they cost against a warm call: bench/mlflow_launch.py
    --parts first)."""
    (tmp_path / "runs").mkdir()
    k = new_kernel(
        env={"AIR_MAGIC_RUNS_DIR": str(tmp_path / "runs"), "AIR_MAGIC_DISPLAY": "text", "MLFLOW_TRACKING_URI": ""},
        cwd=tmp_path,
    )
    k.execute("%load_ext air_magic").check()
    k.execute("from air_magic.tracking import prepare\nprepare.wait()", timeout=180).check()
    (helper,) = supervisor_pids(k)
    wait_idle(helper)
    loaded = {Path(m.path).name for m in psutil.Process(helper).memory_maps()}
    assert any(name.startswith("_sqlite3") for name in loaded), "the helper did not warm the store up before a call"
    assert "torch" not in k.execute("import sys\nsorted(sys.modules)").check().result, "the notebook imported torch"
    k.execute("from air_magic import distributed" + LOGS_AND_COUNTS_IMPORTS).check()
    k.execute("logs = distributed(2, accelerator_type='CPU')(logs_once)").check()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for call in ("first", "second"):
        out = k.execute("logs.distributed('x')", timeout=300).check()
        assert out.result == "[[], []]", f"module files ran in the ranks of the {call} call: {out.result}"
        assert sorted(m.value for m in client.get_metric_history(run_id_of(out.stdout), "x")) == [0.0, 1.0]
    assert supervisor_pids(k) == {helper}, "the calls were not served by the helper that warmed up"
    assert "torch" not in k.execute("import sys\nsorted(sys.modules)").check().result, "the notebook imported torch"


#: An IPython shell (the notebook process) loads the extension, waits for the background work to end, then makes its
#: first call (ranks that log, MLflow's default store). Prints, as JSON, the modules of MLflow's import and store
#: set-up loaded since the last full garbage collection before the call, and how many full collections the call ran.
SHELL_FIRST_CALL = """
import gc, json, sys
sys.path.insert(0, {root!r})

def mlflow_modules():
    return {{name for name in list(sys.modules) if name.partition(".")[0] in ("mlflow", "sqlalchemy", "alembic")}}

seen = {{"before": set(), "call": 0}}
when = ["before"]

def on_gc(phase, info):
    if phase == "start" and info["generation"] == 2:
        if when[0] == "before":
            seen["before"] = mlflow_modules()
        else:
            seen["call"] += 1

gc.callbacks.append(on_gc)
from IPython.core.interactiveshell import InteractiveShell
InteractiveShell.instance().run_line_magic("load_ext", "air_magic")
from air_magic.tracking import prepare
prepare.wait()
when[0] = "call"
since = sorted(mlflow_modules() - seen["before"])

def logs_once(key):
    import os, mlflow
    mlflow.log_metric(key, float(os.environ["RANK"]))
    return 1

from air_magic import distributed
assert distributed(2, accelerator_type="CPU")(logs_once).distributed("x") == [1, 1]
print(json.dumps({{"loaded since": since, "in the call": seen["call"]}}))
from air_magic.owner import owner
owner().shutdown()
"""


@pytest.mark.slow
def test_the_background_preparation_leaves_the_first_call_no_full_garbage_collection(tmp_path):
    """The work %load_ext starts in the notebook ends with a full garbage collection, after MLflow's import and its
    store's set-up, so the first call with MLflow on runs none in the notebook process (MLflow's import leaves one
    due soon; what it cost a first call after a pause: bench/call_patterns.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    (tmp_path / "runs").mkdir()
    env.update(AIR_MAGIC_RUNS_DIR=str(tmp_path / "runs"), AIR_MAGIC_DISPLAY="text")
    done = subprocess.run(
        [sys.executable, "-c", SHELL_FIRST_CALL.format(root=str(ROOT))],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["loaded since"] == [], "modules loaded by the preparation after its last full collection"
    assert seen["in the call"] == 0, "the first call ran a full garbage collection in the notebook process"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(m.value for m in client.get_metric_history(run.info.run_id, "x")) == [0.0, 1.0]


@pytest.mark.slow
def test_background_preparation_starts_once_and_a_caller_waits_for_it(tmp_path):
    """start() twice makes one preparation thread; wait() returns once mlflow is imported and the store is set up;
    running() says whether it was started and is not over."""
    code = f"""
import sys, threading, os
sys.path.insert(0, {str(ROOT)!r})
from air_magic.tracking import prepare
before = prepare.running()
prepare.start(); prepare.start()
names = [t.name for t in threading.enumerate() if t.name == "air_magic-mlflow-prepare"]
during = prepare.running()
prepare.wait()
print(len(names), "mlflow" in sys.modules, os.path.exists("mlflow.db"), "torch" in sys.modules, before, during,
      prepare.running())
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, env=env
    )
    assert done.stdout.split() == ["1", "True", "True", "False", "False", "True", "False"]


SHELL_LOADS = """
import os, sys, threading
sys.path.insert(0, {root!r})
from traitlets.config import Config
from IPython.core.interactiveshell import InteractiveShell
config = Config()
if {off}:
    config.DistributedMagics.mlflow = False
shell = InteractiveShell.instance(config=config)
shell.run_cell({how!r}).raise_error()
started = [t.name for t in threading.enumerate() if t.name == "air_magic-mlflow-prepare"]
from air_magic.tracking import prepare
prepare.wait()
print(len(started), os.path.exists("mlflow.db"))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "off", "expected"),
    [
        ("import air_magic", False, "0 False"),
        ("%load_ext air_magic", False, "1 True"),
        ("%load_ext air_magic", True, "0 False"),
    ],
)
def test_loading_the_extension_prepares_mlflow_unless_cells_are_configured_without_it(tmp_path, how, off, expected):
    """`%load_ext` in an IPython shell starts MLflow's set-up (a plain `import air_magic` does not);
    `DistributedMagics.mlflow = False` in the config makes no store."""
    code = SHELL_LOADS.format(root=str(ROOT), off=off, how=how)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["AIR_MAGIC_WARM"] = "0"  # no helper process: this is about the notebook's side
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, env=env
    )
    assert done.stdout.split()[-2:] == expected.split()
