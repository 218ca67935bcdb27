"""What the ranks use, in the MLflow run; results too large or that cannot be rebuilt, in a real kernel."""

from __future__ import annotations

import mlflow
import pytest
from helpers import reported, run_id_of

# MLflow 3.17's sqlite store uses a SQLAlchemy loader option that SQLAlchemy 2.1 deprecates.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")]

SETUP = "import json, os, warnings\nfrom air_magic import distributed"


def test_the_mlflow_run_gets_each_rank_s_cpu_memory_and_peak_as_system_metrics(kernel, workdir):
    """A 2-rank call of a few seconds leaves system/rank_N/cpu_percent, memory_mib and memory_peak_mib for both
    ranks in its run, sampled a few times, not once per step; rank 0's 200 MiB shows in its peak."""
    kernel.execute(SETUP).check()
    out = kernel.execute(
        """
@distributed(2, accelerator_type="CPU")
def holds():
    import os, time
    block = bytearray(200 * 2**20 if os.environ["RANK"] == "0" else 1)
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(3)
    return len(block)
print(holds.distributed())
""",
        timeout=180,
    ).check()
    run_id = run_id_of(out.stdout)
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    got = client.get_run(run_id).data.metrics
    for rank in (0, 1):
        for name in ("cpu_percent", "memory_mib", "memory_peak_mib"):
            assert f"system/rank_{rank}/{name}" in got, sorted(got)
    assert got["system/rank_0/memory_peak_mib"] >= got["system/rank_1/memory_peak_mib"] + 180
    history = client.get_metric_history(run_id, "system/rank_0/memory_mib")
    assert 1 <= len(history) <= 6  # one every LOG_EVERY (5 s) and one at the end, not one a second


def test_a_large_result_warns_naming_the_rank_its_size_and_what_to_do_instead(kernel):
    """Over the limit (here lowered to 2 MiB), the rank that returned 5 MiB is named with its size, the other
    rank is not, and the advice is to return from rank 0 only or save a checkpoint; under it, no warning."""
    kernel.execute(SETUP).check()
    out = kernel.execute(
        """
@distributed(2, accelerator_type="CPU", mlflow=False)
def gives(size):
    import os
    return b"x" * size if os.environ["RANK"] == "1" else 0
os.environ["AIR_MAGIC_LARGE_RESULT_MIB"] = "2"
try:
    seen = {}
    for size in (5 * 2**20, 2**20):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values = gives.distributed(size)
        seen[size] = [(w.category.__name__, str(w.message)) for w in caught]
finally:
    del os.environ["AIR_MAGIC_LARGE_RESULT_MIB"]
print("REPORT " + json.dumps(seen))
""",
        timeout=180,
    ).check()
    seen = reported(out.stdout)
    assert [c for c, _ in seen[str(2**20)] if c == "ResultSizeWarning"] == []
    [message] = [m for c, m in seen[str(5 * 2**20)] if c == "ResultSizeWarning"]
    assert "rank 1 returned 5 MiB" in message and "rank 0 returned" not in message
    assert "rank 0 only" in message and "checkpoint" in message and "AIR_MAGIC_LARGE_RESULT_MIB" in message


def test_a_result_that_cannot_be_rebuilt_names_its_rank_and_reads_well(kernel):
    """A DDP-wrapped model returned by rank 1 pickles there but not here: the error names rank 1, keeps the
    reason, suggests a state_dict and never ends a sentence twice; when both ranks return one, both are named;
    one that does not even pickle on the rank (its process group gone) reads as well."""
    kernel.execute(SETUP).check()
    out = kernel.execute(
        """
@distributed(2, accelerator_type="CPU", mlflow=False)
def wrapped(who, destroy):
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    rank = dist.get_rank()
    if destroy:
        dist.destroy_process_group()
    return model if rank in who else rank
errors = {}
for who, destroy in (([1], False), ([0, 1], False), ([1], True)):
    try:
        wrapped.distributed(who, destroy)
    except Exception as exc:
        errors[f"{who} {destroy}"] = (type(exc).__name__, str(exc), type(exc.__cause__).__name__)
print("REPORT " + json.dumps(errors))
""",
        timeout=240,
    ).check()
    errors = reported(out.stdout)
    kind, one, cause = errors["[1] False"]
    assert kind == "SerializationError" and cause == "ValueError"
    assert one.startswith("the return value of rank 1 could not be rebuilt in this process (ValueError: ")
    assert "init_process_group" in one and "state_dict()" in one and "rank-1.log" in one
    kind, both, _ = errors["[0, 1] False"]
    assert kind == "SerializationError" and both.startswith("the return values of ranks 0, 1 could not be rebuilt")
    kind, there, _ = errors["[1] True"]
    assert kind == "SerializationError" and "rank 1 (DistributedDataParallel) could not be pickled" in there
    for message in (one, both, there):
        assert ".." not in message and ".;" not in message
