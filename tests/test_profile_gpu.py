"""Profiling on a real GPU: a session cell with `--profile 3` in the ranks that built a `torch.compile`d model, whose
profile counts the compiled model's CUDA kernels (Triton's) among each rank's top ops. Skipped without GPUs."""

from __future__ import annotations

import pytest
from helpers import REAL_NODE, gpu_count

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_count() < 1, reason="needs an NVIDIA GPU"),
]
#: The kernel of this module sees the node's GPUs (the rest of the suite runs the CPU path).
KERNEL_ENV = REAL_NODE

HEAD = "%%distributed --gpus 1 --no-mlflow --session gpuprof"
BUILD = """
import os, torch, torch.distributed as dist, air_magic
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
net = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
model = torch.compile(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 1024, device="cuda")
model(x).square().mean().backward()  # compiled here, once
print("compiled", flush=True)
"""
TRAIN = """
for _ in range(8):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    air_magic.step()
"""


def test_a_session_call_of_a_compiled_model_is_profiled_with_its_cuda_kernels(kernel):
    kernel.execute("%load_ext air_magic").check()
    built = kernel.execute(f"{HEAD}\n{BUILD}", timeout=400).check()
    assert "compiled" in built.stdout, built.stdout
    cell = kernel.execute(f"{HEAD} --profile 3\n{TRAIN}", timeout=400).check()
    assert "profiled 3 step(s) from step 2" in cell.stdout, cell.stdout
    magics = "get_ipython().magics_manager.registry['DistributedMagics']"
    ops = kernel.value(f"[op.name for op in {magics}.last_result.profile.top_ops[0]]")
    assert "triton" in ops, ops  # the compiled model's own kernels, timed on the GPU
    ranks = kernel.value(f"{magics}.last_result.profile.ranks[0]['compute'] > 0")
    assert ranks == "True"
