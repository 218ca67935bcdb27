"""The phases of a call's start as the panel shows them: what it waits for, then running, again after a restart."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import SimpleNamespace

from air_magic.display.widgets import Panel
from air_magic.job import JobResult, JobSpec, JobStatus, RankResult, RankState
from air_magic.listeners import RunContext
from air_magic.phase import Phase


def _started(tmp_path: Path, mlflow: bool = True) -> Panel:
    spec = JobSpec(
        target=print, args=(), kwargs={}, name="f", world_size=2, accelerator_type="CPU", timeout=None, mlflow=mlflow
    )
    ctx = RunContext(spec, tmp_path, [tmp_path / "rank-0.log", tmp_path / "rank-1.log"])
    ctx.phases.append((Phase.CREATING_RUN, 0.0))
    panel = Panel()
    with contextlib.redirect_stdout(io.StringIO()):  # outside a kernel, display() prints
        panel.on_start(ctx)
    panel.handle = SimpleNamespace(update=lambda *args, **kwargs: None)  # display() gives no handle outside a kernel
    return panel


def test_the_panel_follows_the_phases_until_a_rank_runs(tmp_path):
    """The panel says what the start waits for as the runner's phases come, then "running", then ignores phases."""
    panel = _started(tmp_path)
    assert panel.phase == "starting: creating the MLflow run, starting 2 rank(s)"
    panel.on_phase(Phase.STARTING_HELPER)
    assert panel.phase == "starting: starting the helper, starting 2 rank(s)"
    panel.on_phase(Phase.RANKS_STARTING)
    assert panel.phase == "starting: 2 rank(s)"
    panel.on_rank_state(0, RankState.RUNNING)
    assert panel.phase == "running"
    panel.on_phase(Phase.RANKS_STARTING)
    assert panel.phase == "running"


def test_after_a_restart_the_panel_says_starting_again_until_a_rank_runs(tmp_path):
    """A restart shows "starting again" (a phase does not replace it); the next running rank shows "running"."""
    panel = _started(tmp_path, mlflow=False)
    panel.on_rank_state(0, RankState.RUNNING)
    panel.on_attempt(1, "rank 0 failed")
    assert panel.phase == "starting again"
    panel.on_phase(Phase.RANKS_STARTING)
    assert panel.phase == "starting again"
    panel.on_rank_state(1, RankState.RUNNING)
    assert panel.phase == "running"


def test_an_ended_call_keeps_its_end_whatever_a_rank_reports(tmp_path):
    """Once the call ended, a late rank state leaves the panel's words as the end."""
    panel = _started(tmp_path, mlflow=False)
    assert panel.ctx is not None
    result = JobResult(panel.ctx.spec, tmp_path, [RankResult(0), RankResult(1)], status=JobStatus.FINISHED)
    panel.on_end(result)
    assert panel.phase == "finished"
    panel.on_rank_state(1, RankState.RUNNING)
    assert panel.phase == "finished"
