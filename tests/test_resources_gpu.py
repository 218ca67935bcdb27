"""What a rank's GPU uses, read through NVML in the notebook process, on real GPUs. Skipped without GPUs."""

from __future__ import annotations

import mlflow
import pytest
from helpers import REAL_NODE, gpu_count, reported, run_id_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(gpu_count() < 1, reason="needs an NVIDIA GPU"),
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"),
]
#: The kernel of this module sees the node's GPUs (the rest of the suite runs the CPU path).
KERNEL_ENV = REAL_NODE


def test_each_rank_s_gpu_memory_is_sampled_into_the_run_and_the_notebook_never_touches_cuda(kernel, workdir):
    """Every rank holding 4 GiB on its GPU shows gpu_memory_mib and gpu_memory_peak_mib of at least that in the
    MLflow run, with its GPU's utilization, and the notebook process has no CUDA context."""
    out = kernel.execute(
        """
import json, sys
from air_magic import distributed
@distributed()
def holds():
    import os, time, torch
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    block = torch.ones(2**30, device="cuda")  # 4 GiB
    time.sleep(4)
    return int(os.environ["RANK"])
ranks = holds.distributed()
torch = sys.modules.get("torch")
print("REPORT " + json.dumps({"ranks": ranks, "cuda": bool(torch and torch.cuda.is_initialized())}))
""",
        timeout=300,
    ).check()
    report = reported(out.stdout)
    assert report["cuda"] is False
    got = mlflow.MlflowClient(f"sqlite:///{workdir}/mlflow.db").get_run(run_id_of(out.stdout)).data.metrics
    for rank in report["ranks"]:
        assert got[f"system/rank_{rank}/gpu_memory_peak_mib"] >= 4096, got
        assert got[f"system/rank_{rank}/gpu_memory_mib"] >= 4096, got
        assert f"system/rank_{rank}/gpu_utilization_percent" in got
