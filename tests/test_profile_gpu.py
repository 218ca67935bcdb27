"""Profiling on a real GPU: a session cell with `--profile 3` in the ranks that built a `torch.compile`d model, whose
profile has the compiled graph's calls among the rank's top ops and the compiled model's own CUDA kernels (Triton's)
in its trace. Skipped without GPUs."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from helpers import REAL_NODE, gpu_module_marks

pytestmark = gpu_module_marks()
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
    """The matrix products (cuBLAS) lead the top ops of this MLP, beside the compiled graph's calls; the fused
    elementwise kernels that torch.compile wrote (Triton's) are timed on the GPU in the rank's trace."""
    kernel.execute("%load_ext air_magic").check()
    try:
        built = kernel.execute(f"{HEAD}\n{BUILD}", timeout=400).check()
        assert "compiled" in built.stdout, built.stdout
        cell = kernel.execute(f"{HEAD} --profile 3\n{TRAIN}", timeout=400).check()
        assert "profiled 3 step(s) from step 2" in cell.stdout, cell.stdout
        profile = "get_ipython().magics_manager.registry['DistributedMagics'].last_result.profile"
        ops = ast.literal_eval(kernel.value(f"[op.name for op in {profile}.top_ops[0]]"))
        assert any("CompiledFxGraph" in op for op in ops), ops  # the compiled graph's own calls
        assert kernel.value(f"{profile}.ranks[0]['compute'] > 0") == "True"
        trace = Path(ast.literal_eval(kernel.value(f"str({profile}.traces[0])")))
        events = json.loads(trace.read_bytes())["traceEvents"]
        kernels = {e["name"] for e in events if e.get("cat") == "kernel"}
        assert any(name.startswith("triton_") for name in kernels), sorted(kernels)[:20]
    finally:
        kernel.execute("%distributed_release")
