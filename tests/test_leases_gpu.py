"""Machine-wide GPU leases on real GPUs: a command-line run holds every GPU of the node, and a kernel's call waits for
them, says who holds them, and runs once the command-line run ends. Skipped on machines without GPUs."""

from __future__ import annotations

import json
import re
from functools import partial

from helpers import REAL_NODE, air_magic_cli, gpu_count, gpu_module_marks, process_env

pytestmark = gpu_module_marks()
#: The kernel of this module sees the node's GPUs (the rest of the suite runs the CPU path).
KERNEL_ENV = REAL_NODE

#: A function workload on every GPU that holds its device until a flag file appears.
JOB = "experiment_name: gpu-lease\nfunction: hold:main\nmax_retries: 0\n"
HOLD = """\
import os, pathlib, time, torch

def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    x = torch.ones(1, device="cuda")
    print("holding", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
    while not pathlib.Path(__file__).with_name("go").exists():
        time.sleep(0.05)
"""


def test_a_kernels_call_waits_for_the_gpus_a_command_line_run_holds_then_runs(kernel, workdir):
    """`air-magic run` holds every GPU; a kernel's background call of every GPU is `waiting`, naming the command
    line's call by its id, until the run ends; then it runs on the GPUs that run held."""
    (workdir / "job.yaml").write_text(JOB)
    (workdir / "hold.py").write_text(HOLD)
    env = process_env({**REAL_NODE, "AIR_MAGIC_RUNS_DIR": str(workdir / "runs"), "MLFLOW_TRACKING_URI": ""})

    cli = partial(air_magic_cli, workdir, env)

    started = json.loads(cli("run", "-f", "job.yaml", "--json").stdout)["data"]
    kernel.execute("%load_ext air_magic").check()
    kernel.execute(
        "import json, time\nfrom pathlib import Path\nfrom air_magic import attach, distributed\n"
        f"cli_call = attach({started['id']!r})\n"
        "deadline = time.monotonic() + 300\n"
        "while 'holding' not in cli_call.logs(0):\n"
        "    assert time.monotonic() < deadline, cli_call.logs(0)\n"
        "    time.sleep(0.1)\n"
        "@distributed(mlflow=False)\n"
        "def where():\n"
        "    import os\n"
        "    return os.environ['CUDA_VISIBLE_DEVICES']\n"
        "mine = where.spawn()\n"
        "while not mine.waiting_for and mine.status == 'waiting':\n"
        "    time.sleep(0.05)\n"
        "print('REPORT', json.dumps([mine.status, mine.waiting_for]))\n",
        timeout=400,
    ).check()
    out = kernel.execute("print('REPORT', json.dumps([mine.status, mine.waiting_for]))").check()
    status, waiting_for = json.loads(out.stdout.split("REPORT ", 1)[1])
    # the holder as the lease names it: "call <id> (<name>) (cli pid <pid>)"
    assert status == "waiting" and "GPU" in waiting_for, waiting_for
    assert f"call {started['id']} (" in waiting_for and "(cli pid " in waiting_for, waiting_for
    (workdir / "go").touch()
    out = kernel.execute("print('REPORT', json.dumps([mine.result(), mine.status]))", timeout=300).check()
    devices, status = json.loads(out.stdout.split("REPORT ", 1)[1])
    assert status == "finished" and len(devices) == gpu_count()
    run_dir = workdir / "runs" / started["id"]  # the command line's run has ended: its ranks' logs are whole
    held = [
        d for r in range(gpu_count()) for d in re.findall(r"holding (\S+)", (run_dir / f"rank-{r}.log").read_text())
    ]
    assert sorted(devices) == sorted(held), (devices, held)
    assert json.loads(cli("get", started["id"], "--json").stdout)["data"]["status"] == "SUCCESS"
