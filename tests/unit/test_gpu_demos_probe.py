"""bench/gpu_demos.py's appended cell: it reads the step times a demo returns, and never fails a demo that has none."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def probe_prints(namespace: dict) -> dict:
    """What the appended cell prints after a notebook that left `namespace`."""
    spec = importlib.util.spec_from_file_location("bench_gpu_demos", ROOT / "bench" / "gpu_demos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(module.PROBE, dict(namespace))  # noqa: S102 - the cell the notebook runs, run here
    (line,) = [ln for ln in out.getvalue().splitlines() if ln.startswith(module.MARK)]
    return json.loads(line[len(module.MARK) :])


def test_step_times_of_a_list_by_rank_and_of_the_deepspeed_stages():
    """A list by rank gives one unnamed group; the DeepSpeed demo's {stage: list} one group per ZeRO stage."""
    assert probe_prints({"results": [{"step_time_s": 0.1}, {"step_time_s": 0.2}]}) == {"": [0.1, 0.2]}
    assert probe_prints({"results": {2: [{"step_time_s": 0.3}], 3: [{"step_time_s": 0.4}]}}) == {
        "ZeRO-2": [0.3],
        "ZeRO-3": [0.4],
    }


@pytest.mark.parametrize("namespace", [{}, {"results": [{"rank": 0}]}, {"results": [3, 4]}], ids=str)
def test_a_demo_that_times_no_steps_prints_none_instead_of_failing(namespace):
    """No `results` (the sessions demo), or results without step times (restarts, data resume): no group, no error."""
    assert probe_prints(namespace) == {}
