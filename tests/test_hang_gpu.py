"""A hang on real GPUs (nccl): NCCL's flight recorder is on in GPU ranks and its dump lands in the run directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import REAL_NODE, gpu_count, reported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(gpu_count() < 2, reason="needs two NVIDIA GPUs: rank 0 and rank 1 each on a GPU of its own"),
]
#: The kernel of this module sees the node's GPUs (the rest of the suite runs the CPU path).
KERNEL_ENV = REAL_NODE


def test_a_collective_only_one_rank_enters_leaves_the_flight_recorder_dump_with_the_logs(kernel):
    """Rank 0 waits in an all_reduce rank 1 never joins: NCCL's watchdog (10 s here) dumps each rank's flight recorder
    into the run directory's flight_recorder/, the ranks saw the recorder's settings, and the error says how to read
    it and which rank waits in which collective."""
    out = kernel.execute(
        """
import json
from air_magic import distributed

@distributed(2, timeout=120, mlflow=False)
def lonely_all_reduce():
    import datetime, os, time, torch, torch.distributed as dist
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=10))
    env = os.environ
    size = env.get("TORCH_FR_BUFFER_SIZE") or env["TORCH_NCCL_TRACE_BUFFER_SIZE"]
    print("FR " + size + " " + env["TORCH_NCCL_DUMP_ON_TIMEOUT"], flush=True)
    dist.all_reduce(torch.ones(1, device="cuda"))  # a warm-up both ranks enter
    torch.cuda.synchronize()
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1, device="cuda"))
        torch.cuda.synchronize()
    time.sleep(60)

try:
    lonely_all_reduce.distributed()
except BaseException as exc:
    print("REPORT " + json.dumps({"type": type(exc).__name__, "notes": getattr(exc, "__notes__", [])}))
""",
        timeout=240,
    ).check()
    assert "FR 2000 1" in out.stdout, out.stdout[-3000:]
    report = reported(out.stdout)
    logs = [line for line in out.stdout.splitlines() if "logs in " in line]
    run_dir = Path(logs[-1].split("logs in ", 1)[1].split()[0])
    dumps = sorted((run_dir / "flight_recorder").glob("rank_*"))
    assert dumps and dumps[0].stat().st_size > 0, (report, sorted(run_dir.iterdir()))
    assert any("torchfrtrace" in note for note in report["notes"]), report
    said = " ".join(report["notes"])
    assert "rank 0 waits in all_reduce #2; rank 1 never reached it" in said, report
