"""The runtime's documented single-node forms on a real GPU, through `air-magic run` as a subprocess: the
hyperparameters file (one H100, a plain python command) as written, and the first training job's torchrun form
(8 H100) refused on a smaller machine with the overrides that fit, then run with exactly those; its torchrun rank
meets over NCCL and the node's watch names the GPU that rank holds memory on. Skipped on machines without GPUs."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from helpers import REAL_NODE, gpu_count, gpu_module_marks

pytestmark = gpu_module_marks()

#: The command line of this module sees the node's GPUs (the rest of the suite runs the CPU path).
KERNEL_ENV = REAL_NODE
WORKLOADS = Path(__file__).parent / "workloads"

TRAIN = """\
import os, sys, time
import torch

if "LOCAL_RANK" in os.environ:  # started by the command's torchrun
    import torch.distributed as dist
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    total = torch.ones(1, device="cuda")
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} nccl sum {total.item()}", flush=True)
else:  # the plain python form, with its parameters
    import yaml
    config = yaml.safe_load(open(sys.argv[sys.argv.index("--config") + 1]))
    print("lr", config["learning_rate"], "optimizer", config["optimizer"]["name"], flush=True)
held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, held while the node's watch looks
print("on", torch.cuda.get_device_name(), flush=True)
time.sleep(4)
"""

CLI_FILES = {
    "code/train.py": TRAIN,
    "hyperparameters.yaml": (WORKLOADS / "hyperparameters.yaml").read_text(),
    "first_job.yaml": (WORKLOADS / "first_job.yaml").read_text(),
}
ROOT = ("--override", "code_source.snapshot.root_path=code")


def _data(done) -> dict:
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)["data"]


def test_the_hyperparameters_file_runs_as_written_on_the_gpu(cli):
    """One GPU of the file's type, `python $CODE_SOURCE_PATH/train.py --config $HYPERPARAMETERS_PATH`: the script
    reads its parameters and uses the GPU; the run ends SUCCESS with exit code 0."""
    done = cli("run", "-f", "hyperparameters.yaml", "--watch", *ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lr 0.0001 optimizer adamw" in done.stdout and "on NVIDIA" in done.stdout
    assert "SUCCESS" in done.stdout.splitlines()[-1]


def test_the_torchrun_form_is_refused_with_the_overrides_that_fit_and_runs_with_them(cli):
    """The 8-GPU file on a machine with fewer GPUs exits 2 naming the overrides that fit; with those (and torchrun
    over as many processes), the command's rank meets over NCCL, holds 1 GiB on a GPU that `get` names, and the run
    ends SUCCESS."""
    refused = cli("run", "-f", "first_job.yaml", *ROOT)
    if gpu_count() >= 8:
        pytest.skip("this machine has the 8 GPUs the file asks for")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    fits = re.search(r"run on them with (--override \S+ --override \S+)", refused.stdout + refused.stderr)
    assert fits, refused.stdout + refused.stderr
    command = f"command=torchrun --nproc_per_node={gpu_count()} $CODE_SOURCE_PATH/train.py"
    done = cli("run", "-f", "first_job.yaml", "--watch", *ROOT, *shlex.split(fits.group(1)), "--override", command)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"rank 0 of {gpu_count()} nccl sum {float(gpu_count())}" in done.stdout
    run_id = done.stdout.split("Submitted workload with Run ID: ", 1)[1].split()[0]
    got = _data(cli("get", run_id, "-o", "json"))
    assert got["status"] == "SUCCESS"
    ranks = got["command_ranks"]
    assert len(ranks) == gpu_count() and all(rank["gpus"] for rank in ranks), ranks
    assert all(held >= 1 << 30 for rank in ranks for held in rank["gpus"].values()), ranks
    assert len({index for rank in ranks for index in rank["gpus"]}) == gpu_count(), ranks
