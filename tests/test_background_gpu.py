"""Background calls on real GPUs: a second call waits for the first one's GPUs and then runs on them.
Skipped on machines without GPUs."""

from __future__ import annotations

import json

from helpers import REAL_NODE, gpu_count, gpu_module_marks

pytestmark = gpu_module_marks()
#: The kernel of this module sees the node's GPUs (the rest of the suite runs the CPU path).
KERNEL_ENV = REAL_NODE

SETUP = """
import json, pathlib, time
from air_magic import distributed

@distributed(mlflow=False)  # every GPU of the node
def hold(flag):
    import os, pathlib, time, torch
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    x = torch.ones(1024, device="cuda")
    print("holding", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
    while not pathlib.Path(flag).exists():
        time.sleep(0.05)
    return (os.environ["CUDA_VISIBLE_DEVICES"], float(x.sum()))

def until(check, limit=300):
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.05)
"""


def test_a_second_background_call_waits_for_the_first_ones_gpus_and_then_runs(kernel, workdir):
    """Two calls of every GPU: the second is `waiting` (for the GPUs the first holds) while the first runs, then
    runs on the same GPUs once the first ends, and both return their values."""
    kernel.execute("%load_ext air_magic").check()
    kernel.execute(SETUP).check()
    flag = workdir / "go"
    kernel.execute(f"first = hold.spawn({str(flag)!r})\nuntil(lambda: 'holding' in first.logs(0))").check()
    kernel.execute(f"second = hold.spawn({str(flag)!r})").check()
    out = kernel.execute(
        "print('REPORT', json.dumps([first.status, second.status, second.waiting_for, first.id]))"
    ).check()
    first_status, second_status, waiting_for, first_id = json.loads(out.stdout.split("REPORT ", 1)[1])
    assert (first_status, second_status) == ("running", "waiting"), out.stdout
    assert "GPU(s)" in waiting_for and f"held by call {first_id} (hold)" in waiting_for, waiting_for  # by its id
    flag.touch()
    out = kernel.execute("print('REPORT', json.dumps([first.result(), second.result(), second.status]))", timeout=300)
    first, second, status = __import__("json").loads(out.check().stdout.split("REPORT ", 1)[1])
    assert status == "finished" and len(first) == len(second) == gpu_count()
    assert [v for _, v in first] == [1024.0] * gpu_count() and [d for d, _ in first] == [d for d, _ in second]
