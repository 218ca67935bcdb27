"""Every demo notebook, executed headless in a real kernel on 2 CPU ranks, and what it really did.

The quickstart (through run.py), the sessions demo, and a large captured dataset here; the DDP demos in
test_demos_ddp.py, the sharded ones in test_demos_sharded.py (separate modules, so that the two test workers
share them). The assertions are on the values each notebook prints and on the MLflow store the workers wrote
to. Data passed from the notebook is also checked to arrive on every rank, and a large captured dataset to
raise a PayloadSizeWarning naming its size.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from demos_common import DEMOS, assert_loss_goes_down, run_demo

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow


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
    cells = nbformat.read(copy, as_version=4).cells
    printed = "".join(o.get("text", "") for c in cells if c.cell_type == "code" for o in c.outputs)
    assert f"96 loss values logged to MLflow run {run_id.group(1)}" in printed, printed
    # the last cell: rank 1's slower DataLoader is named, with its cause, and nothing else is flagged
    last = cells[-1]
    alerts = "".join(o.get("data", {}).get("text/plain", "") for o in last.outputs)
    assert re.fullmatch(r"\[\('straggler', 1, 'input', \d+\.\d+\)\]", alerts), alerts


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


@pytest.mark.timeout(900)
def test_background_notebook_trains_while_cells_run_and_sweeps_two_trials(demo_dir):
    """The background demo: the loss is read from MLflow while the spawned training runs, the handle's result comes
    back, and both trials of the sweep finish with their last loss compared."""
    probe = '{"seen": len(history), "losses": [r["last_epoch_loss"] for r in results], "statuses": trials.statuses}'
    got = run_demo("background.ipynb", demo_dir, probe)
    assert got["seen"] > 0 and len(got["losses"]) == 2
    assert got["statuses"] == ["finished", "finished"]


def test_profiling_notebook_names_the_rank_with_more_work_and_its_cause(demo_dir):
    """The profiling demo's rank 1, doing more work each step under DDP, is the slowest, by its compute; rank 0 waits
    in the collectives; the merged trace is written."""
    got = run_demo(
        "profiling.ipynb", demo_dir, '{"slowest": profile.slowest, "ranks": profile.ranks, "trace": str(profile.trace)}'
    )
    assert got["slowest"] == [1, "compute"], got
    rank0, rank1 = got["ranks"]
    assert rank0["collective"] > rank1["collective"] and rank1["compute"] > rank0["compute"], got
    assert Path(got["trace"]).is_file()
