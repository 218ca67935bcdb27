"""Running a demo notebook in a test: demo_notebooks/run.py loaded once, and what the notebook printed read back.

Each notebook runs through demo_notebooks/run.py (nbclient) in a private working directory; a cell appended
by the test prints the notebook's results as JSON (`run_demo`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from helpers import ROOT, mlflow_store

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


def _env(workdir: Path) -> dict[str, str]:
    return {
        "AIR_MAGIC_RUNS_DIR": str(workdir / "runs"),
        "MLFLOW_TRACKING_URI": mlflow_store(workdir),
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
