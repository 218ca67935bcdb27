"""What filled a GPU's memory, on a real GPU: an out-of-memory error names the rank, its memory and the largest live
allocation sites (the function that filled it among them) and leaves a snapshot; each rank's peak is in its result.
Skipped on machines without GPUs."""

from __future__ import annotations

from helpers import REAL_NODE, gpu_module_marks

pytestmark = gpu_module_marks()
#: The kernel of this module sees the node's GPUs (the rest of the suite runs the CPU path).
KERNEL_ENV = REAL_NODE

FILL = """
from air_magic import distributed

def fill_up(chunks):
    import torch
    while True:  # 1 GiB at a time until the GPU is full
        chunks.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))

@distributed(1, timeout=300, mlflow=False, memory_history={history})
def run_out():
    fill_up([])

try:
    run_out.distributed()
except Exception as exc:
    error = exc
notes = "\\n".join(getattr(error, "__notes__", []))
print(type(error).__name__)
print(notes)
"""


def test_an_out_of_memory_error_names_the_sites_that_filled_the_memory(kernel):
    """With memory_history=True, the OOM error raised in the notebook names rank 0, its allocated, reserved and free
    memory, `fill_up` as the largest live site, and a snapshot whose pickle holds torch's segments."""
    out = kernel.execute(FILL.format(history=True), timeout=300).check()
    assert "OutOfMemoryError" in out.stdout.splitlines(), out.stdout  # the error's type, as the cell printed it
    assert "air_magic: rank 0 ran out of GPU memory on cuda:0" in out.stdout
    assert "allocated" in out.stdout and "reserved" in out.stdout and " free of " in out.stdout
    sites = out.stdout.split("largest live allocation sites (file, line, function, size):\n", 1)[1]
    assert " at fill_up (" in sites.splitlines()[0], sites
    path = kernel.value("notes.split('Snapshot: ', 1)[1].split(' (open it', 1)[0]").strip("'")
    assert path.endswith("rank-0.memory.pickle")
    assert kernel.value(f"'segments' in __import__('pickle').load(open({path!r}, 'rb'))") == "True"


def test_without_the_history_the_error_says_how_to_get_it(kernel):
    """With the history off (the default) the error still names the rank and its memory, and how to see the sites."""
    out = kernel.execute(FILL.format(history=False), timeout=300).check()
    assert "air_magic: rank 0 ran out of GPU memory" in out.stdout and "memory_history=True" in out.stdout, out.stdout


def test_each_ranks_peak_allocated_memory_is_in_its_result(kernel):
    """A rank that held 256 MiB at most reports a peak of at least that, from torch's own counter."""
    kernel.execute(
        """
from air_magic import distributed

@distributed(1, timeout=300, mlflow=False)
def hold():
    import torch
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del x

peak = hold.run().ranks[0].gpu_peak_allocated
"""
    ).check()
    assert int(kernel.value("peak")) >= 256 << 20
