"""The data_resume demo notebook, executed headless in a real kernel on CPU ranks, and what it really did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from demos_common import DEMOS, PROBE, demo_run
from helpers import mlflow_store

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow


@pytest.mark.timeout(1500)
def test_data_resume_notebook_resumes_model_optimizer_and_data_on_another_number_of_ranks(tmp_path: Path):
    """Trained on 2 ranks and interrupted at step 11, it resumes from step 8 on 1 rank and trains on every file exactly
    once per epoch."""
    run_py = demo_run
    (tmp_path / "runs").mkdir()
    probe = (
        '{"checkpoints": sorted(p.name for p in CHECKPOINTS.iterdir()), "results": results, '
        '"exactly_once": exactly_once, "mean_loss": mean_loss}'
    )
    run = run_py.execute(
        DEMOS / "data_resume.ipynb",
        workdir=tmp_path,
        output=tmp_path / "data_resume.ipynb",
        timeout=900,
        env={"AIR_MAGIC_RUNS_DIR": str(tmp_path / "runs"), "MLFLOW_TRACKING_URI": mlflow_store(tmp_path)},
        append=[f"import json as _json\nprint({PROBE!r} + _json.dumps({probe}))"],
    )
    logs = "\n".join(
        f"--- {log}\n" + "\n".join(log.read_text().splitlines()[-15:])
        for d in run.run_dirs
        for log in sorted(d.glob("rank-*.log"))
    )
    assert run.error is None, f"data_resume.ipynb failed:\n{run.error}\nlast lines of every rank:\n{logs}"
    text = run_py.stream_text(run.notebook)
    assert "interrupted: simulated preemption at step 11" in text
    assert sorted(len(list(d.glob("rank-*.log"))) for d in run.run_dirs) == [1, 2], (
        "expected a 2-rank run, then a 1-rank run"
    )
    line = next(ln for ln in run_py.cell_text(run.notebook.cells[-1]).splitlines() if ln.startswith(PROBE))
    got = json.loads(line[len(PROBE) :])
    [result] = got["results"]
    assert result["world"] == 1 and result["resumed_from"].endswith("/step-00008") and result["last_step"] == 28
    assert "resumed from" in text and "epoch 1, 32 of its files done, step 8, on 1 rank(s)" in text
    assert got["exactly_once"] == {"0": True, "1": True, "2": True}
    assert "step-00028" in got["checkpoints"]
    losses = got["mean_loss"]
    assert losses["2"] < 0.5 * losses["0"], f"loss did not go down across the interruption: {losses}"
