"""Every demo notebook, executed headless in a real kernel on 2 CPU ranks, and what it really did.

Each notebook runs through demo_notebooks/run.py (nbclient) in a private working
directory; a cell appended by the test prints the notebook's results as JSON,
and the assertions are on those values and on the MLflow store the workers
wrote to. Data passed from the notebook is also checked to arrive on every rank,
and a large captured dataset to raise a PayloadSizeWarning naming its size.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import ROOT

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow

DEMOS = ROOT / "demo_notebooks"
PROBE = "PROBE-JSON:"


def _load_run_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo_run", DEMOS / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_run"] = module
    spec.loader.exec_module(module)
    return module


demo_run = _load_run_py()


@pytest.fixture
def demo_dir(tmp_path: Path) -> Path:
    (tmp_path / "runs").mkdir()
    return tmp_path


def _env(workdir: Path) -> dict[str, str]:
    return {
        "AIR_MAGIC_RUNS_DIR": str(workdir / "runs"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/mlflow.db",
    }


def run_demo(name: str, workdir: Path, probe: str) -> dict:
    """Execute demo_notebooks/<name> on 2 CPU ranks, then return what `probe` (an expression) evaluates to."""
    code = f"import json as _json\nprint({PROBE!r} + _json.dumps({probe}))"
    run = demo_run.execute(
        DEMOS / name, workdir=workdir, output=workdir / name, timeout=600, env=_env(workdir), append=[code]
    )
    assert run.error is None, f"{name} failed:\n{run.error}"
    assert run.run_dirs, f"{name} made no air_magic run directory under {workdir / 'runs'}"
    for run_dir in run.run_dirs:
        assert sorted(p.name for p in run_dir.glob("rank-*.log")) == ["rank-0.log", "rank-1.log"]
    printed = demo_run.cell_text(run.notebook.cells[-1])
    line = next(ln for ln in printed.splitlines() if ln.startswith(PROBE))
    return json.loads(line[len(PROBE) :])


def assert_loss_goes_down(losses: list[float], what: str) -> None:
    head, tail = losses[: max(1, len(losses) // 4)], losses[-max(1, len(losses) // 4) :]
    assert sum(tail) / len(tail) < 0.8 * sum(head) / len(head), f"{what}: loss did not go down: {losses}"


@pytest.mark.timeout(900)
def test_quickstart_through_run_py_logs_a_falling_loss_to_the_default_mlflow_store(demo_dir):
    """`run.py quickstart.ipynb` trains on 2 ranks, logs the loss at every step to MLflow's local default store and
    prints where the copy, results and run are."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # MLflow's own default
    env["AIR_MAGIC_RUNS_DIR"] = str(demo_dir / "runs")
    copy = demo_dir / "executed-quickstart.ipynb"
    proc = subprocess.run(
        [
            sys.executable,
            str(DEMOS / "run.py"),
            str(DEMOS / "quickstart.ipynb"),
            "--workdir",
            str(demo_dir),
            "--output",
            str(copy),
            "--timeout",
            "600",
        ],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"executed copy: {copy}" in out and copy.is_file()
    results = re.search(r"results and per-rank logs: (\S+) \(rank-0.log, rank-1.log\)", out)
    assert results and Path(results.group(1)).parent == demo_dir / "runs", out
    assert "epoch 2: mean loss" in (Path(results.group(1)) / "rank-1.log").read_text()

    store = demo_dir / "mlflow.db"
    assert store.is_file(), f"no MLflow store in the notebook's directory:\n{out}"
    run_id = re.search(r"MLflow run ([0-9a-f]{32}) .* store sqlite:///(\S+)", out)
    assert run_id and Path(run_id.group(2)) == store, out
    with sqlite3.connect(store) as db:
        rows = db.execute(
            "SELECT step, value FROM metrics WHERE run_uuid = ? AND key = 'loss' ORDER BY step", (run_id.group(1),)
        ).fetchall()
    steps = [s for s, _ in rows]
    assert steps == list(range(96)), f"expected one loss per step (3 epochs x 32 steps), got steps {steps}"
    assert_loss_goes_down([v for _, v in rows], "quickstart")
    assert f"96 loss values logged to MLflow run {run_id.group(1)}" in out


@pytest.mark.timeout(900)
def test_ddp_notebook_ships_the_notebooks_model_and_keeps_replicas_identical(demo_dir):
    """The DDP demo: every rank gets the model built in the notebook, the loss goes down, and parameters are identical
    on every rank after training."""
    got = run_demo(
        "ddp.ipynb",
        demo_dir,
        '{"notebook": notebook_params.tolist(), "ranks": [r["rank"] for r in results], '
        '"losses": [r["epoch_losses"] for r in results], '
        '"received": [r["received_params"].tolist() for r in results], '
        '"trained": [r["trained_params"].tolist() for r in results]}',
    )
    assert got["ranks"] == [0, 1]
    for rank, received in enumerate(got["received"]):
        assert received == got["notebook"], f"rank {rank} did not get the notebook's model"
    assert got["trained"][0] == got["trained"][1], "DDP replicas differ after training"
    assert got["trained"][0] != got["notebook"], "training did not change the parameters"
    for rank, losses in enumerate(got["losses"]):
        assert_loss_goes_down(losses, f"rank {rank}")


@pytest.mark.timeout(900)
def test_fsdp_notebook_shards_every_parameter_across_the_ranks(demo_dir):
    """The FSDP2 demo: each rank holds half of every parameter as a Shard(0) DTensor, and the loss goes down."""
    got = run_demo(
        "fsdp.ipynb",
        demo_dir,
        '[{k: r[k] for k in ("rank", "losses", "full_sizes", "local_sizes", "placements")} for r in results]',
    )
    assert [r["rank"] for r in got] == [0, 1]
    full = got[0]["full_sizes"]
    assert len(full) == 6 and sum(full.values()) > 0
    for name, size in full.items():
        held = [r["local_sizes"][name] for r in got]
        assert held == [size // 2, size // 2], f"{name}: {size} elements, ranks hold {held}"
    for r in got:
        assert set(r["placements"].values()) == {"(Shard(dim=0),)"}
        assert sum(r["local_sizes"].values()) * 2 == sum(full.values())
        assert_loss_goes_down(r["losses"], f"rank {r['rank']}")


@pytest.mark.timeout(1200)
def test_deepspeed_notebook_runs_zero_stage_2_and_3(demo_dir):
    """The DeepSpeed demo: the engine reports ZeRO stage 2, then 3, as asked; under stage 3 each rank holds only its
    partition; the loss goes down."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail(
            "DeepSpeed is not installed: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed (make test does)"
        )
    got = run_demo(
        "deepspeed.ipynb",
        demo_dir,
        '{str(s): [{k: r[k] for k in ("rank", "zero_stage", "losses", "partitions")} for r in rs] '
        "for s, rs in results.items()}",
    )
    assert sorted(got) == ["2", "3"]
    for stage, per_rank in got.items():
        assert [r["rank"] for r in per_rank] == [0, 1]
        assert [r["zero_stage"] for r in per_rank] == [int(stage), int(stage)]
        for r in per_rank:
            assert_loss_goes_down(r["losses"], f"stage {stage} rank {r['rank']}")
    assert got["2"][0]["partitions"] == {}
    for r in got["3"]:
        parts = r["partitions"]
        assert len(parts) == 6
        for name, (held, full) in parts.items():
            assert held == -(-full // 2), f"ZeRO-3 rank {r['rank']} holds {held} of {full} elements of {name}"


@pytest.mark.timeout(900)
def test_distributed_magic_notebook_trains_ddp_from_a_cell(demo_dir):
    """The %%distributed demo: a cell using the notebook's class and helper trains DDP on 2 ranks; loss goes down,
    replicas identical."""
    got = run_demo(
        "distributed_magic.ipynb",
        demo_dir,
        '{"ranks": [r["rank"] for r in results], "losses": [r["losses"] for r in results], '
        '"trained": [r["trained_params"].tolist() for r in results]}',
    )
    assert got["ranks"] == [0, 1]
    assert got["trained"][0] == got["trained"][1]
    for rank, losses in enumerate(got["losses"]):
        assert_loss_goes_down(losses, f"rank {rank}")


def test_every_demo_picks_its_backend_in_one_visible_line_and_says_so():
    """Each notebook's first cell says NCCL on GPUs and gloo on CPU, and its code picks the backend in one line."""
    line = 'backend = "nccl" if torch.cuda.is_available() else "gloo"'
    notebooks = sorted(DEMOS.glob("*.ipynb"))
    assert {p.name for p in notebooks} >= {
        "quickstart.ipynb",
        "ddp.ipynb",
        "fsdp.ipynb",
        "deepspeed.ipynb",
        "distributed_magic.ipynb",
    }
    for path in notebooks:
        nb = json.loads(path.read_text())
        first = "".join(nb["cells"][0]["source"])
        assert nb["cells"][0]["cell_type"] == "markdown" and "NCCL on GPUs" in first and "gloo on CPU" in first, path
        code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        assert code.count(line) == 1, f"{path.name}: the backend line should appear exactly once"
        assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), f"{path.name} has outputs"


@pytest.mark.timeout(900)
def test_large_captured_dataset_warns_with_its_size_and_small_arguments_reach_every_rank(kernel):
    """A 267 MiB tensor captured from the notebook gives a PayloadSizeWarning naming it, its size and the advice, in
    every cell that sends it; the call still works."""
    kernel.execute(
        "import torch\nfrom air_magic import distributed\nbig = torch.arange(70_000_000, dtype=torch.float32)"
    ).check()
    kernel.execute(
        "@distributed(2)\ndef uses_big(offset):\n    import os\n"
        "    return (int(os.environ['RANK']), big.numel(), float(big[12345]) + offset)"
    ).check()
    for attempt in range(2):  # each cell that sends it is told, not only the first
        out = kernel.execute("values = uses_big.distributed(offset=1.0)\nvalues", timeout=300).check()
        assert "PayloadSizeWarning" in out.stderr, out.stderr
        assert "267 MiB" in out.stderr and "global 'big'" in out.stderr, out.stderr
        assert "load large data inside the function" in out.stderr, out.stderr
        assert out.result == "[(0, 70000000, 12346.0), (1, 70000000, 12346.0)]", (attempt, out.result)


@pytest.mark.timeout(900)
def test_sessions_notebook_builds_once_survives_a_mistake_and_a_stopped_loop(demo_dir):
    """The sessions demo: the model built in one cell trains in later ones, through a typo and a loop stopped by its
    timeout; the pulled loss curve covers all 20 steps and goes down."""
    got = run_demo("sessions.ipynb", demo_dir, '{"curve": curve}')
    assert len(got["curve"]) == 20
    assert_loss_goes_down(got["curve"], "rank 0")
