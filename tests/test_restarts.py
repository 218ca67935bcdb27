"""max_restarts: a call whose rank fails starts its whole world again, driven from a real Jupyter kernel."""

from __future__ import annotations

import json
import re
import sqlite3
import time

import pytest
from faults_common import alive, run_dirs, run_here
from helpers import leftover_processes, run_id_of
from widget_state import WidgetMirror, run_cell

from air_magic.owner import owner

pytestmark = pytest.mark.slow

SETUP = """
import os, time
from air_magic import distributed

class TrainingDiverged(ValueError):
    pass

@distributed(2, accelerator_type="CPU", timeout=120, max_restarts=1)
def killed_once():
    import os, pathlib, signal, time
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {os.environ['RANK']} in attempt {attempt}", flush=True)
    printed = pathlib.Path(f"rank-0-printed-{os.environ['MASTER_PORT']}")  # one attempt's ranks share its port
    if os.environ["RANK"] == "0":
        printed.touch()
    if attempt == 0:
        if os.environ["RANK"] == "1":
            while not printed.exists():  # rank 0's line is in its log before rank 1 dies, however late it started
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    return (int(os.environ["RANK"]), attempt, os.environ["TORCHELASTIC_MAX_RESTARTS"])

@distributed(2, accelerator_type="CPU", timeout=120, max_restarts=2)
def always_diverges():
    import os, time
    if os.environ["RANK"] == "1":
        raise TrainingDiverged(f"loss is nan in attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
    time.sleep(120)
"""

MLFLOW_RUN = """
from mlflow import MlflowClient
_run = MlflowClient().get_run({run_id!r})
_same_dir = MlflowClient().search_runs([_run.info.experiment_id], "tags.`air_magic.run_dir` = '{run_dir}'")
print(_run.info.status, _run.data.tags.get("air_magic.restarts"), len(_same_dir), _run.data.params.get("max_restarts"))
"""


@pytest.fixture(scope="module")
def restart_kernel(kernel):
    """The module's kernel with the restart tests' helpers defined (SETUP)."""
    kernel.execute(SETUP).check()
    return kernel


def mlflow_run(restart_kernel, stdout: str) -> str:
    """'<status> <restarts tag> <runs made for this call> <max_restarts param>' of the call's MLflow run."""
    [run_dir] = run_dirs(stdout)
    return restart_kernel.execute(MLFLOW_RUN.format(run_id=run_id_of(stdout), run_dir=run_dir)).check().stdout.strip()


def test_a_rank_killed_in_the_first_attempt_restarts_the_call_which_returns_the_second_attempts_results(restart_kernel):
    """SIGKILL of rank 1 with max_restarts=1: every rank starts again and the call returns attempt 1's values."""
    out = restart_kernel.execute(
        "result = killed_once.run()\nprint(result.values, result.attempts, result.status.value)", timeout=180
    ).check()
    assert "[(0, 1, '1'), (1, 1, '1')] 2 FINISHED" in out.stdout
    assert "attempt 2 of 2, every rank starts again after: rank 1 was killed by signal 9 (SIGKILL)" in out.stdout
    [run_dir] = run_dirs(out.stdout)
    log = (run_dir / "rank-0.log").read_text()
    marker = "===== air_magic: attempt 2 of 2; every rank starts again after: rank 1 was killed by signal 9 (SIGKILL)"
    assert log.index("rank 0 in attempt 0") < log.index(marker) < log.index("rank 0 in attempt 1")
    assert out.stdout.count("[rank 0] rank 0 in attempt 0") == 1, "the second attempt's tail read the first one again"
    assert (run_dir / "attempt-0" / "payload.pkl").exists() and (run_dir / "rank-1.result.pkl").exists()
    assert mlflow_run(restart_kernel, out.stdout) == "FINISHED 1 1 1"


def test_the_same_rank_killed_without_restarts_is_a_worker_died_error(restart_kernel):
    """With max_restarts=0 the killed rank ends the call at once, as before: WorkerDiedError naming it."""
    err = restart_kernel.execute("killed_once.with_overrides(max_restarts=0).distributed()", timeout=180)
    assert err.ename == "WorkerDiedError", err.traceback
    assert "rank 1 was killed by signal 9 (SIGKILL)" in err.traceback and "earlier attempts" not in err.traceback


def test_a_rank_that_always_raises_gets_three_attempts_then_its_exception_lists_the_earlier_ones(restart_kernel):
    """max_restarts=2: three attempts, then the rank's own exception type and traceback, noting attempts 1 and 2."""
    msg = restart_kernel.send("always_diverges.distributed()")
    out = restart_kernel.collect(msg, timeout=180)
    assert out.ename == "TrainingDiverged", out.traceback
    assert "loss is nan in attempt 2" in out.traceback and "raise TrainingDiverged" in out.traceback
    assert "attempt 1: rank 1 raised TrainingDiverged: loss is nan in attempt 0" in out.traceback
    assert "attempt 2: rank 1 raised TrainingDiverged: loss is nan in attempt 1" in out.traceback
    assert "this is attempt 3" in out.traceback and "failed after 3 attempts" in out.stdout
    assert mlflow_run(restart_kernel, out.stdout) == "FAILED 2 1 2"


def test_the_cell_magic_takes_max_restarts_from_its_option_or_the_configured_default(restart_kernel):
    """%%distributed --max-restarts 1 restarts a killed rank; so does c.DistributedMagics.default_max_restarts; -1 is
    refused."""
    restart_kernel.execute("%load_ext air_magic").check()
    cell = (
        "import os, signal, time\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['RANK'] == '0':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "int(os.environ['TORCHELASTIC_RESTART_COUNT'])"
    )
    assert (
        restart_kernel.execute(f"%%distributed --gpus 2 --no-mlflow --max-restarts 1\n{cell}", timeout=180)
        .check()
        .result
        == "[1, 1]"
    )
    err = restart_kernel.execute(f"%%distributed --gpus 2 --no-mlflow\n{cell}", timeout=180)
    assert err.ename == "WorkerDiedError"
    restart_kernel.execute("%config DistributedMagics.default_max_restarts = 1").check()
    try:
        assert (
            restart_kernel.execute(f"%%distributed --gpus 2 --no-mlflow\n{cell}", timeout=180).check().result
            == "[1, 1]"
        )
        bad = restart_kernel.execute("%config DistributedMagics.default_max_restarts = -1")
        assert "default_max_restarts" in bad.traceback + bad.stderr
    finally:
        restart_kernel.execute("%config DistributedMagics.default_max_restarts = 0").check()
    out = restart_kernel.execute("%%distributed --max-restarts -1\n1")
    assert "UsageError" in out.stderr and "0 or more" in out.stderr


def test_an_interrupt_with_restarts_left_ends_the_call_without_a_restart(restart_kernel):
    """Ctrl-C during a call with max_restarts=3 stops every rank and raises KeyboardInterrupt; no attempt 2 starts."""
    restart_kernel.execute(
        "@distributed(2, accelerator_type='CPU', timeout=None, max_restarts=3, mlflow=False)\n"
        "def sleeps():\n    import os, time\n"
        "    print('asleep', os.environ['TORCHELASTIC_RESTART_COUNT'], flush=True)\n"
        "    time.sleep(300)"
    ).check()
    msg = restart_kernel.send("sleeps.distributed()")
    out = restart_kernel.collect(msg, timeout=60, interrupt_when=lambda o: o.stdout.count("asleep 0") == 2)
    assert out.ename == "KeyboardInterrupt", out.traceback
    assert "attempt 2" not in out.stdout and "asleep 1" not in out.stdout
    [run_dir] = run_dirs(out.stdout)
    assert not (run_dir / "attempt-0").exists() and "=====" not in (run_dir / "rank-0.log").read_text()
    left = leftover_processes(set(), wait=5, kind="job")
    assert left == [], [(p.pid, p.cmdline()) for p in left]


def killed_once_hot(started: str):
    """Rank 1 kills itself in attempt 0 once rank 0 has said its pid (the file `started`), not before: rank 0's
    first line is what the test reads."""
    import os
    import signal
    import time

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"PID {os.getpid()} attempt {attempt}", flush=True)
    if attempt == 0 and os.environ["RANK"] == "0":
        open(started, "w").close()
    if attempt == 0 and os.environ["RANK"] == "1":
        deadline = time.monotonic() + 120
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    return os.getpid()


@pytest.mark.usefixtures("here_runs")
def test_hot_ranks_that_fail_end_and_the_restart_runs_in_fresh_ranks(tmp_path):
    """keep_alive with a killed rank: the failed attempt's hot ranks are ended, the restart gets new processes."""
    try:
        result = run_here(killed_once_hot, str(tmp_path / "rank-0-started"), keep_alive=60, max_restarts=1)
        text = (result.run_dir / "rank-0.log").read_text()
        first = [int(pid) for pid in re.findall(r"PID (\d+) attempt 0", text)]
        assert result.attempts == 2 and len(first) == 1
        assert first[0] not in result.values
        deadline = time.monotonic() + 15
        while alive(first) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(first) == [], "the failed attempt's hot rank 0 is still alive"
    finally:
        owner().launchers.local.release_hot()


def test_the_log_and_the_record_keep_every_attempt(restart_kernel):
    """The static record (text/plain twin) shows 'attempt 2 of 2' and the earlier failure; each log keeps both
    attempts."""
    out = restart_kernel.execute(
        "from air_magic.display.record import record_bundle\n"
        "from air_magic.display.tail import TailBuffer\n"
        "r = killed_once.with_overrides(mlflow=False).run()\n"
        "tails = [TailBuffer() for _ in r.ranks]\n"
        "[t.feed(p.log_path.read_text()) for t, p in zip(tails, r.ranks)]\n"
        "print(record_bundle(r, tails, [p.log_path for p in r.ranks], None)['text/plain'])",
        timeout=180,
    ).check()
    assert "finished on attempt 2 of 2" in out.stdout
    assert "earlier attempt 1: rank 1 was killed by signal 9 (SIGKILL)" in out.stdout
    assert "[rank 1] rank 1 in attempt 0" in out.stdout and "[rank 1] rank 1 in attempt 1" in out.stdout


@pytest.fixture(scope="module")
def panel_kernel(new_module_kernel, workdir):
    """A real ipykernel that shows the live panel (its default display mode)."""
    k = new_module_kernel(env={"AIR_MAGIC_RUNS_DIR": str(workdir / "runs")}, display="auto")
    run_cell(k, SETUP, WidgetMirror()).check()
    return k


def test_the_panel_shows_the_attempt_and_why_the_last_one_ended(panel_kernel):
    """After a restart the panel's status says 'attempt 2 of 2' and why attempt 1 ended; each tab keeps both
    attempts."""
    mirror = WidgetMirror()
    out = run_cell(panel_kernel, "killed_once.with_overrides(mlflow=False).distributed()", mirror).check()
    assert out.result == "[(0, 1, '1'), (1, 1, '1')]"
    panel = mirror.panel()
    assert "attempt 2 of 2 (after: rank 1 was killed by signal 9 (SIGKILL))" in panel["status"]
    assert panel["titles"] == ["rank 0: done", "rank 1: done"]
    log = panel["logs"][1]
    assert (
        log.index("rank 1 in attempt 0")
        < log.index("===== air_magic: attempt 2 of 2")
        < log.index("rank 1 in attempt 1")
    )
    record = out.displays[-1]["data"]
    assert "attempt 2 of 2" in record["text/html"] and "attempt 1: rank 1 was killed" in record["text/plain"]


@pytest.mark.timeout(900)
def test_the_restarts_demo_resumes_by_itself_and_trains_on_every_file_exactly_once_per_epoch(tmp_path):
    """restarts.ipynb: rank 1 SIGKILLed at step 11, the call restarts from step 10 and every file counts once per
    epoch."""
    from demos_common import DEMOS, PROBE, demo_run

    (tmp_path / "runs").mkdir()
    probe = (
        '{"results": results, "attempts": result.attempts, "earlier": result.earlier_failures, '
        '"exactly_once": exactly_once}'
    )
    run = demo_run.execute(
        DEMOS / "restarts.ipynb",
        workdir=tmp_path,
        output=tmp_path / "restarts.ipynb",
        timeout=600,
        env={"AIR_MAGIC_RUNS_DIR": str(tmp_path / "runs"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"},
        append=[f"import json as _json\nprint({PROBE!r} + _json.dumps({probe}))"],
    )
    assert run.error is None, f"restarts.ipynb failed:\n{run.error}"
    line = next(ln for ln in demo_run.cell_text(run.notebook.cells[-1]).splitlines() if ln.startswith(PROBE))
    got = json.loads(line[len(PROBE) :])
    assert got["attempts"] == 2 and got["earlier"] == ["rank 1 was killed by signal 9 (SIGKILL)"]
    assert [(r["attempt"], r["last_step"]) for r in got["results"]] == [(1, 24), (1, 24)]
    assert all(r["resumed_from"].endswith("/step-00010") for r in got["results"])
    assert got["exactly_once"] == {"0": True, "1": True, "2": True}
    [run_dir] = run.run_dirs
    log = (run_dir / "rank-1.log").read_text()
    assert (
        log.index("killed at step 11")
        < log.index("===== air_magic: attempt 2 of 3")
        < log.index("resumed from step-00010")
    )
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        rows = db.execute(
            "SELECT r.status, t.value FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
            "WHERE t.key = 'air_magic.restarts'"
        ).fetchall()
    assert rows == [("FINISHED", "1")]


@pytest.fixture
def ray_cluster_of_three(cluster, tmp_path, monkeypatch):
    """The shared simulated Ray cluster (tests/ray_cluster.py) with a third 2-CPU worker node (one spare), this
    process joined to it; after the test it has two worker nodes again."""
    import sys

    import cloudpickle
    import ray_cluster

    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path))
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray_cluster.add_node(cluster)
    return cluster


def hangs_on_its_node_in_the_first_attempt():
    import os
    import time

    import ray

    node = ray.get_runtime_context().get_node_id()
    print("NODE", node, flush=True)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        time.sleep(600)
    return node


@pytest.mark.timeout(600)
def test_a_ray_node_removed_mid_run_restarts_the_call_on_the_nodes_left(ray_cluster_of_three):
    """Rank 1's node leaves the cluster: with a restart allowed, the call runs again on the nodes left and succeeds."""
    import ray_cluster
    from faults_common import Recorder

    from air_magic import distributed

    cluster = ray_cluster_of_three
    removed: dict[str, str] = {}

    class RemoveRank1Node(Recorder):
        def poll(self) -> None:
            found = re.search(r"NODE (\w+)\n", self.output(1))
            if found and not removed and self.ctx.attempt == 0:
                removed["node"] = found.group(1)
                cluster.remove_node(ray_cluster.node_of(cluster, removed["node"]), allow_graceful=False)

    func = hangs_on_its_node_in_the_first_attempt
    spec = distributed(1, accelerator_type="CPU", num_nodes=2, mlflow=False, max_restarts=1, timeout=300)(func)
    result = owner().submit(spec.settings.spec(func, (), {}, func.__name__), listeners=[RemoveRank1Node()])
    assert result.error is None, repr(result.error)
    assert result.attempts == 2 and removed["node"] not in result.values and len(set(result.values)) == 2
    assert "rank 1 was lost" in result.earlier_failures[0] and "left the Ray cluster" in result.earlier_failures[0]
    ray_cluster.wait_all_free()
