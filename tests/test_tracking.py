"""MLflow tracking of calls, in a real kernel, against a real local store and a real local MLflow UI."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import mlflow
import psutil
import pytest
from helpers import ROOT, SESSION, leftover_processes, run_id_of

# MLflow 3.17's sqlite store uses a SQLAlchemy loader option that SQLAlchemy 2.1 deprecates.
pytestmark = [pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"), pytest.mark.slow]

UI_PATTERN = re.compile(r"mlflow(\.exe)?\s+(ui|server)\b|-m\s+mlflow\s+(ui|server)\b")
LINK = re.compile(r"MLflow run: (\S+)")


def mlflow_ui_processes(before: set[int] = frozenset()) -> list[psutil.Process]:
    """Live processes of this test session whose command line runs `mlflow ui` or `mlflow server`, not in `before`."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid in before:
            continue
        try:
            if (
                proc.status() != psutil.STATUS_ZOMBIE
                and UI_PATTERN.search(" ".join(proc.cmdline()))
                and proc.environ().get("AIR_MAGIC_TEST_SESSION") == SESSION
            ):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def wait_gone(before: set[int], timeout: float = 30.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        left = mlflow_ui_processes(before)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.3)


def mine(proc: psutil.Process) -> bool:
    """A live process started from this checkout (other checkouts may run their own tests meanwhile)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and str(ROOT) in " ".join(proc.cmdline())
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A fresh working directory with no tracking URI configured: MLflow's local default lands here."""
    path = tmp_path_factory.mktemp("mlflow-default_store_kernel")
    (path / "runs").mkdir()
    return path


@pytest.fixture(scope="module")
def default_store_kernel(new_module_kernel, store):
    """A kernel with no MLflow configuration; killed outright at the end, after which no MLflow UI may remain."""
    ui_before = {p.pid for p in mlflow_ui_processes()}
    procs_before = {p.pid for p in psutil.process_iter()}
    k = new_module_kernel(
        env={"AIR_MAGIC_RUNS_DIR": str(store / "runs"), "AIR_MAGIC_DISPLAY": "text", "MLFLOW_TRACKING_URI": ""},
        cwd=store,
    )
    k.execute("import os, time, re\nimport mlflow\nfrom air_magic import distributed").check()
    # The import set the default store up in the background; the tests' own client opens it only after that.
    k.execute("from air_magic.tracking import prepare\nprepare.wait()").check()
    yield k
    k.kc.stop_channels()
    k.km.shutdown_kernel(now=True)  # SIGKILL: the hardest way for a kernel to go
    left = wait_gone(ui_before)
    for p in left:
        p.kill()
    assert not left, f"MLflow UI processes outlived their kernel: {[p.cmdline()[:6] for p in left]}"
    others = [(p.pid, " ".join(p.cmdline()[:3])) for p in leftover_processes(procs_before, wait=20) if mine(p)]
    for pid, _ in others:
        psutil.Process(pid).kill()
    assert not others, f"processes left behind: {others}"


@pytest.fixture
def client(store):
    return mlflow.MlflowClient(f"sqlite:///{store}/mlflow.db")


def test_call_makes_a_finished_run_with_settings_metrics_and_logs(default_store_kernel, store, client):
    """A call on the default local store makes a FINISHED run with its settings, both ranks' metrics and rank logs."""
    out = default_store_kernel.execute(
        """
@distributed(num_accelerators=2, timeout=600)
def train(steps):
    import os, mlflow
    rank = int(os.environ["RANK"])
    for i in range(steps):
        mlflow.log_metric(f"loss_{rank}", 1.0 / (i + 1), step=i)
    print(f"rank {rank} done")
    return rank
train.distributed(25)
""",
        timeout=300,
    ).check()
    assert out.result == "[0, 1]"
    assert (store / "mlflow.db").exists(), "with no tracking URI the run goes to MLflow's default ./mlflow.db"
    run = client.get_run(run_id_of(out.stdout))
    assert run.info.status == "FINISHED"
    assert run.data.params == {"function": "train", "world_size": "2", "accelerator_type": "CPU", "timeout": "600"}
    assert client.get_experiment(run.info.experiment_id).name == "air_magic"
    for rank in (0, 1):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, f"loss_{rank}")) == list(range(25))
    logs = sorted(a.path for a in client.list_artifacts(run.info.run_id, "logs"))
    assert logs == ["logs/rank-0.log", "logs/rank-1.log"]
    text = Path(client.download_artifacts(run.info.run_id, "logs/rank-1.log")).read_text()
    assert "rank 1 done" in text


def test_a_profiled_call_logs_every_trace_as_an_artifact(default_store_kernel, store, client):
    """profile=3: each rank's trace and the merged one are artifacts of the call's run, under profile/."""
    out = default_store_kernel.execute(
        """
@distributed(num_accelerators=2, timeout=600, profile=3)
def looped():
    import torch, torch.distributed as dist, air_magic
    dist.init_process_group("gloo")
    for _ in range(6):
        dist.all_reduce(torch.ones(4))
        air_magic.step()
    dist.destroy_process_group()
looped.distributed()
""",
        timeout=300,
    ).check()
    run = client.get_run(run_id_of(out.stdout))
    names = sorted(a.path for a in client.list_artifacts(run.info.run_id, "profile"))
    assert names == ["profile/profile.trace.json", "profile/rank-0.trace.json", "profile/rank-1.trace.json"]


def test_link_opens_the_run_in_a_local_ui_on_loopback_over_the_same_store(default_store_kernel):
    """The printed link points at a local MLflow UI on 127.0.0.1 whose API serves the run and its metric."""
    out = default_store_kernel.execute(
        """
@distributed(num_accelerators=2)
def one():
    import mlflow
    mlflow.log_metric("acc", 0.5)
one.distributed()
"""
    ).check()
    link = LINK.search(out.stdout).group(1)
    assert link.startswith("http://127.0.0.1:"), link
    base, fragment = link.split("#", 1)
    run_id = fragment.split("?", 1)[0].rsplit("/", 1)[-1]
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{base}ajax-api/2.0/mlflow/runs/get?run_id={run_id}", timeout=5) as r:
                data = json.loads(r.read())
            break
        except OSError:
            assert time.monotonic() < deadline, "the local MLflow UI never answered"
            time.sleep(1)
    keys = [m["key"] for m in data["run"]["data"]["metrics"]]
    assert [k for k in keys if not k.startswith("system/")] == ["acc"]  # system/: what the ranks used
    with urllib.request.urlopen(base, timeout=10) as r:
        page = r.read().lower()
    if (Path(mlflow.__file__).parent / "server" / "js" / "build" / "index.html").exists():
        assert b"<html" in page
    else:  # mlflow-skinny ships no UI pages: the link still reaches MLflow's server, which says so
        assert b"landing page (index.html) not found" in page
    listening = {
        c.laddr.ip
        for p in mlflow_ui_processes()
        for proc in [p, *p.children(recursive=True)]
        for c in proc.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert listening == {"127.0.0.1"}, listening
    assert len(mlflow_ui_processes()) >= 1
    again = default_store_kernel.execute("one.distributed()").check()
    assert LINK.search(again.stdout).group(1).split("#")[0] == base, "later calls reuse the same UI"


def test_the_local_ui_starts_when_its_link_is_first_opened_not_with_the_call(default_store_kernel, tmp_path):
    """A call prints its link at once but starts no MLflow UI; the first request to the link starts the UI and is
    answered by it, and a later call reuses it."""
    before = {p.pid for p in mlflow_ui_processes()}
    code = f"""
os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///{tmp_path}/lazy.db"
@distributed(num_accelerators=2)
def lazy():
    import mlflow
    mlflow.log_metric("seen", 1.0)
try:
    lazy.distributed()
finally:
    del os.environ["MLFLOW_TRACKING_URI"]
"""
    out = default_store_kernel.execute(code).check()
    base, fragment = LINK.search(out.stdout).group(1).split("#", 1)
    assert base.startswith("http://127.0.0.1:"), base
    assert not mlflow_ui_processes(before), "a UI was started before anybody opened the link"
    run_id = fragment.split("?", 1)[0].rsplit("/", 1)[-1]
    with urllib.request.urlopen(f"{base}ajax-api/2.0/mlflow/runs/get?run_id={run_id}", timeout=180) as r:
        data = json.loads(r.read())  # the first request waits for the UI to start, then is answered by it
    assert [m["key"] for m in data["run"]["data"]["metrics"] if not m["key"].startswith("system/")] == ["seen"]
    started = mlflow_ui_processes(before)
    assert started, "opening the link started no MLflow UI"
    again = default_store_kernel.execute(code).check()
    assert LINK.search(again.stdout).group(1).split("#")[0] == base, "a later call reuses the same UI"
    assert {p.pid for p in mlflow_ui_processes(before)} == {p.pid for p in started}


def test_nested_run_and_experiment_chosen_in_the_notebook(default_store_kernel, client):
    """With an active run and an experiment set in the notebook, the call is a child run in that experiment."""
    out = default_store_kernel.execute(
        """
mlflow.set_experiment("chosen-here")
with mlflow.start_run(run_name="outer") as outer:
    @distributed(num_accelerators=2)
    def inner():
        import os, mlflow
        mlflow.log_metric("x", float(os.environ["RANK"]))  # distinct per rank: MLflow keeps identical points once
    inner.distributed()
print("OUTER", outer.info.run_id)
"""
    ).check()
    outer = re.search(r"OUTER (\w+)", out.stdout).group(1)
    run = client.get_run(run_id_of(out.stdout))
    assert run.data.tags["mlflow.parentRunId"] == outer
    assert client.get_experiment(run.info.experiment_id).name == "chosen-here"
    assert len(client.get_metric_history(run.info.run_id, "x")) == 2


def test_worker_set_experiment_gets_a_clear_warning_and_still_logs(default_store_kernel, client):
    """A rank that calls mlflow.set_experiment is told where its metrics go, and they still land on the call's run."""
    out = default_store_kernel.execute(
        """
mlflow.set_experiment("chosen-here")
@distributed(num_accelerators=2)
def stubborn():
    import os, mlflow
    mlflow.set_experiment("somewhere-else")
    mlflow.log_metric("y", 2.0 + int(os.environ["RANK"]))  # distinct per rank, as above
stubborn.distributed()
"""
    ).check()
    assert "mlflow.set_experiment('somewhere-else') ignored on rank 0" in out.stdout
    assert "call mlflow.set_experiment('somewhere-else') in the notebook before the call" in out.stdout
    assert "does not match environment run ID" not in out.stdout
    assert len(client.get_metric_history(run_id_of(out.stdout), "y")) == 2


def test_failed_and_timed_out_calls_end_failed_and_killed(default_store_kernel, client):
    """A rank that raises ends the run FAILED; a call stopped by its timeout ends it KILLED, logs stored in both."""
    failed = default_store_kernel.execute(
        """
@distributed(num_accelerators=2)
def boom():
    raise ValueError("bad batch")
boom.distributed()
"""
    )
    assert failed.ename == "ValueError"
    run = client.get_run(run_id_of(failed.stdout))
    assert run.info.status == "FAILED"
    assert len(client.list_artifacts(run.info.run_id, "logs")) == 2
    slow = default_store_kernel.execute(
        """
@distributed(num_accelerators=2, timeout=3)
def slow():
    import time
    time.sleep(120)
slow.distributed()
""",
        timeout=180,
    )
    assert slow.ename == "DistributedTimeoutError"
    assert client.get_run(run_id_of(slow.stdout)).info.status == "KILLED"


def test_interrupted_call_ends_killed(default_store_kernel, client):
    """Interrupting the kernel during a call ends its run KILLED."""
    msg = default_store_kernel.send(
        """
@distributed(num_accelerators=2)
def forever():
    import time
    print("started", flush=True)
    time.sleep(300)
forever.distributed()
"""
    )
    deadline = time.monotonic() + 120
    seen = ""
    while "[rank 1] started" not in seen or "[rank 0] started" not in seen:
        assert time.monotonic() < deadline, f"ranks did not start: {seen}"
        m = default_store_kernel.kc.get_iopub_msg(timeout=120)
        if m["parent_header"].get("msg_id") == msg and m["msg_type"] == "stream":
            seen += m["content"]["text"]
    default_store_kernel.interrupt()
    out = default_store_kernel.collect(msg, timeout=120)
    assert out.ename == "KeyboardInterrupt"
    assert client.get_run(run_id_of(seen)).info.status == "KILLED"


def test_no_mlflow_means_no_run_and_no_mlflow_in_workers(default_store_kernel, client):
    """mlflow=False makes no run and leaves the workers without mlflow or its run variables."""
    before = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    out = default_store_kernel.execute(
        """
@distributed(num_accelerators=2, mlflow=False)
def plain():
    import os, sys
    return ("mlflow" in sys.modules, "MLFLOW_RUN_ID" in os.environ)
plain.distributed()
"""
    ).check()
    assert out.result == "[(False, False), (False, False)]"
    assert "MLflow run" not in out.stdout
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == before


def test_workers_do_not_import_mlflow_unless_the_function_does(default_store_kernel):
    """With tracking on, a function that does not use mlflow runs in workers that never import it."""
    out = default_store_kernel.execute(
        """
@distributed(num_accelerators=2)
def untouched():
    import os, sys
    return ("mlflow" in sys.modules, bool(os.environ.get("MLFLOW_RUN_ID")))
untouched.distributed()
"""
    ).check()
    assert out.result == "[(False, True), (False, True)]"


def test_eight_ranks_logging_every_step_lose_no_metric(default_store_kernel, client):
    """8 ranks each logging 2,000 steps to the default local sqlite store: every metric arrives, no lock errors."""
    out = default_store_kernel.execute(
        """
@distributed(num_accelerators=8, timeout=1200)
def classic(steps):
    import os, mlflow
    for i in range(steps):
        mlflow.log_metric("loss", 1.0 / (i + 1) + int(os.environ["RANK"]), step=i)
    return os.environ["RANK"]
classic.distributed(2000)
""",
        timeout=1300,
    )
    assert out.error is None, out.traceback + out.stdout[-3000:]
    assert "database is locked" not in out.stdout
    assert "Failed to log run data" not in out.stdout
    run_id = run_id_of(out.stdout)
    history = client.get_metric_history(run_id, "loss")
    assert len(history) == 8 * 2000
    assert sorted({m.step for m in history}) == list(range(2000))


def test_configured_server_link_is_that_servers_run_page():
    """With an http(s) tracking URI the link is the configured server's page for the run, and no local UI starts."""
    from air_magic.tracking import ui as mlflow_ui

    before = {p.pid for p in mlflow_ui_processes()}
    url = mlflow_ui.run_url("https://mlflow.example.org/", "7", "abc123")
    assert url == "https://mlflow.example.org/#/experiments/7/runs/abc123?workflowType=machine_learning"
    assert not mlflow_ui._uis and not mlflow_ui_processes(before)


def test_unreachable_tracking_server_warns_and_the_call_still_runs(default_store_kernel):
    """When the run cannot be created, the call runs without MLflow and a warning says why and how to turn it off."""
    out = default_store_kernel.execute(
        """
import warnings
os.environ.update(MLFLOW_TRACKING_URI="http://127.0.0.1:9", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        @distributed(num_accelerators=2)
        def still():
            return 3
        print("RESULT", still.distributed())
finally:
    del os.environ["MLFLOW_TRACKING_URI"], os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
print("WARNED", [str(w.message) for w in caught if "MLflow tracking is off" in str(w.message)])
""",
        timeout=300,
    ).check()
    assert "RESULT [3, 3]" in out.stdout
    assert "pass mlflow=False" in out.stdout and "127.0.0.1:9" in out.stdout
