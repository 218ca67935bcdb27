"""Detached calls in real kernels: a call started with detach=True keeps running when its kernel is SIGKILLed;
another kernel lists it (%distributed_calls --all), attaches to it (its lines so far) and gets its result;
`%%distributed --detach` does the same for a cell."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import wait_until

from air_magic.calls import record as call_record

pytestmark = pytest.mark.slow

SETUP = """
%load_ext air_magic
from air_magic import distributed

@distributed(2, accelerator_type="CPU", mlflow=False, detach=True)
def wait_for(flag):
    import os, pathlib, time
    print("working on rank", os.environ["RANK"], flush=True)
    while not pathlib.Path(flag).exists():
        time.sleep(0.05)
    return int(os.environ["RANK"])
"""


def test_a_detached_call_outlives_its_kernels_sigkill_and_another_kernel_gets_its_result(
    workdir, loaded_kernel, new_kernel
):
    """Kernel 1 spawns a detached call and is killed with SIGKILL mid-call; the call still runs, kernel 2 sees it in
    %distributed_calls --all, attaches with every line so far, and its result() is each rank's value."""
    flag = workdir / "go"
    first = new_kernel()
    first.execute(SETUP).check()
    started = first.execute(f"h = wait_for.spawn({str(flag)!r}); print('ID', h.id)").check()
    call_id = started.stdout.split("ID ", 1)[1].split()[0]
    run_dir = Path(workdir / "runs" / call_id)

    def working() -> bool:
        return all("working" in (run_dir / f"rank-{r}.log").read_text() for r in (0, 1))

    wait_until(working, 300, "both ranks never printed", step=0.2)
    first.kill()
    record = call_record.load(run_dir)
    assert record is not None and record["status"] == "running" and record["owner"]["role"] == "detached"
    listed = loaded_kernel.execute("%distributed_calls --all").check().stdout
    assert call_id in listed and "running" in listed
    attached = loaded_kernel.execute(f"import air_magic\nh = air_magic.attach({call_id[:22]!r})").check().stdout
    assert "[rank 0] working on rank 0" in attached and "[rank 1] working on rank 1" in attached
    flag.touch()
    got = loaded_kernel.execute("print(h.result(timeout=280), h.status)", timeout=300)
    assert got.stdout.strip() == "[0, 1] finished", (got.stdout, got.traceback, (run_dir / "owner.log").read_text())


def test_a_detached_cell_returns_a_handle_whose_result_is_the_cells_value(loaded_kernel):
    """`%%distributed --detach` returns a DistributedCall at once; its result() is the cell's value by rank."""
    loaded_kernel.execute(
        "%%distributed --detach --gpus 2 --accelerator-type CPU --no-mlflow --out cellcall\n"
        "import os\nint(os.environ['RANK']) * 10"
    ).check()
    got = loaded_kernel.execute("print(cellcall.result(timeout=280))", timeout=300)
    assert got.stdout.strip() == "[0, 10]", (got.stdout, got.traceback)
