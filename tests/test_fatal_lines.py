"""A rank's fatal output line (the runtime's patterns: out of memory, NCCL, segfault, ...) is an alert of the call:
in `handle.alerts`, the text display, the record on disk and the MLflow run's tags; once per rank and kind."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import reported, run_id_of

from air_magic.calls import record as call_record

pytestmark = pytest.mark.slow

CALL = """
import os, sys, json, mlflow
from air_magic import distributed

@distributed(2, accelerator_type="CPU")
def prints_fatal_lines():
    import os, sys
    if os.environ["RANK"] == "1":
        for _ in range(3):  # the same kind again: still one alert
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr, flush=True)
        print("an ordinary line about memory", flush=True)
        print("NCCL WARN NET/Socket : Connection closed by remote peer", end="", flush=True)  # no newline at the end
    return 0

result = prints_fatal_lines.run().raise_for_status()
print("REPORT " + json.dumps({
    "alerts": [[a.kind, a.rank, a.cause, a.message] for a in result.alerts],
    "run_dir": str(result.run_dir),
}))
"""


def test_a_ranks_fatal_lines_are_alerts_shown_recorded_and_tagged(kernel):
    done = kernel.execute(CALL, timeout=300).check()
    seen = reported(done.stdout)
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert seen["alerts"] == [
        ["oom", 1, "output", f"rank 1: oom: {oom}"],
        ["nccl", 1, "output", "rank 1: nccl: NCCL WARN NET/Socket : Connection closed by remote peer"],
    ]
    assert f"air_magic: rank 1: oom: {oom}" in done.stdout  # the text display's alert line
    kept = call_record.read(Path(seen["run_dir"]))["alerts"]  # type: ignore[index]
    assert [(a["kind"], a["rank"]) for a in kept] == [("oom", 1), ("nccl", 1)]
    tags = kernel.execute(
        f"print('REPORT ' + json.dumps(mlflow.MlflowClient().get_run({run_id_of(done.stdout)!r}).data.tags))"
    ).check()
    tags = reported(tags.stdout)
    assert tags["air_magic.call_alert_0"] == f"oom: rank 1: oom: {oom}"
    assert tags["air_magic.call_alert_1"].startswith("nccl: rank 1: nccl: NCCL WARN NET/Socket")
    assert "air_magic.call_alert_2" not in tags
