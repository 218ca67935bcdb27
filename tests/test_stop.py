"""Stop after this step, and native frames in a hung rank's stacks: real kernels, 2 CPU ranks."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from helpers import cell_values as values
from helpers import distributed_cell as cell
from helpers import wait_until

from air_magic.launch.files import step_times
from air_magic.launch.files.rundir import RunDir
from air_magic.stopping import request_stop

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("releases_hot_ranks")]

#: Two CPU ranks, no MLflow run.
CPU = "--gpus 2 --accelerator-type CPU --no-mlflow"


def _run_dir_printing(runs: Path, text: str, after: float, rank: int = 0, limit: float = 90) -> Path:
    """The run directory, made after `after`, whose rank `rank` has printed `text`."""
    found: list[Path] = []

    def printed() -> bool:
        for path in runs.iterdir():
            log = path / f"rank-{rank}.log"
            if path.is_dir() and path.stat().st_mtime >= after and log.exists() and text in log.read_text():
                found.append(path)
                return True
        return False

    wait_until(printed, limit, f"no rank printed {text!r}")
    return found[0]


def test_a_stop_ends_a_session_loop_at_the_same_step_on_both_ranks_and_keeps_the_session(loaded_kernel, workdir):
    """Stop asked while a session cell's loop runs: both ranks leave the loop at the same step, the cell returns
    normally, and the next cell of the session finds what the first left."""
    cell(
        loaded_kernel,
        f"--session stopping {CPU}",
        "import torch.distributed as dist\ndist.init_process_group('gloo')\nNone",
    ).check()
    started = time.time() - 1
    msg = loaded_kernel.send(
        f"""%%distributed --session stopping {CPU}
import time
from air_magic import should_stop
stopped_at = None
for step in range(600):
    print("step", step, flush=True)
    time.sleep(0.05)
    if should_stop():
        stopped_at = step
        break
stopped_at
"""
    )
    run_dir = _run_dir_printing(workdir / "runs", "step 3", started)
    assert request_stop(run_dir)
    result = loaded_kernel.collect(msg, timeout=120).check()
    steps = values(result)
    assert steps[0] is not None and steps[0] == steps[1] and 3 <= steps[0] < 599, steps
    kept = values(cell(loaded_kernel, f"--session stopping {CPU}", "(stopped_at, dist.is_initialized())"))
    assert kept == [(steps[0], True)] * 2


def _same_step_from(asked: int, steps: list[int]) -> None:
    """Both ranks ended at the same step, at or soon after the one the Stop was asked in (a rank looks at the flag
    at most every 50 ms, so quick steps may run a few more)."""
    assert steps[0] == steps[1] and asked <= steps[0] < 10_000, steps


_ASK_AT_3 = """
import os
from air_magic.stopping import request_stop

def ask_at_3(step):
    # what the panel's Stop does, from rank 0 at step 3: the flag in the call's run directory
    if step == 3 and os.environ["RANK"] == "0":
        request_stop(os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"])
"""


def test_the_hugging_face_callback_ends_trainer_train_at_the_same_step_on_both_ranks(loaded_kernel):
    """transformers.Trainer with TrainerStopCallback: a Stop at step 3 ends train() at one step on both ranks."""
    out = cell(
        loaded_kernel,
        CPU,
        _ASK_AT_3
        + """
import tempfile, torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from air_magic.integrations import TrainerStopCallback

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), labels)}

class AskAt3(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        ask_at_3(state.global_step)

data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(64)]
args = TrainingArguments(tempfile.mkdtemp(), max_steps=10_000, per_device_train_batch_size=2, report_to=[],
                         save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True)
trainer = Trainer(Tiny(), args, train_dataset=data, callbacks=[AskAt3(), TrainerStopCallback()])
trainer.train()
trainer.state.global_step
""",
        timeout=300,
    )
    _same_step_from(3, values(out))


def test_the_lightning_callback_ends_fit_at_the_same_step_on_both_ranks(loaded_kernel):
    """A Lightning Trainer (ddp, 2 CPU ranks) with LightningStopCallback: a Stop at step 3 ends fit() there."""
    out = cell(
        loaded_kernel,
        CPU,
        _ASK_AT_3
        + """
import torch
import lightning.pytorch as pl
from air_magic.integrations import LightningStopCallback

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)
    def on_train_batch_end(self, outputs, batch, index):
        ask_at_3(self.trainer.global_step)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256))
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=10_000, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[LightningStopCallback()])
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
trainer.global_step
""",
        timeout=300,
    )
    _same_step_from(3, values(out))


HANG = """
from air_magic import distributed

@distributed(num_accelerators=2, accelerator_type="CPU", timeout=600, mlflow=False)
def hang():
    import time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        time.sleep(600)
    print("waiting in all_reduce", flush=True)
    dist.all_reduce(torch.ones(1))

hang.distributed()
"""


def test_a_hung_ranks_stacks_reach_its_native_frames(loaded_kernel, workdir):
    """Ctrl-C while rank 1 waits in gloo's all_reduce: the stacks in its log go on below Python, into libtorch."""
    started = time.time() - 1
    msg = loaded_kernel.send(HANG)
    run_dir = _run_dir_printing(workdir / "runs", "waiting in all_reduce", started, rank=1, limit=240)

    def in_the_collective() -> bool:  # as rank 1's watched steps say
        state = step_times.read(RunDir(run_dir).steps(1))
        return state is not None and state.collective is not None and state.collective.op == "all_reduce"

    wait_until(in_the_collective, 60, "rank 1 never waited in its all_reduce")
    loaded_kernel.interrupt()
    loaded_kernel.collect(msg, timeout=180)
    log = (run_dir / "rank-1.log").read_text()
    refused = re.search(r"air_magic: no native stacks of pid \d+: (.*)", log)
    if refused and "ptrace" in refused[1]:
        pytest.skip(f"py-spy may not attach here: {refused[1]}")
    assert "air_magic: native stacks of pid" in log, log[-3000:]
    native = log.split("(py-spy dump --native):", 1)[1]
    assert re.search(r"\| +\S.*\(libtorch\S*\.so\S*\)", native), native[:3000]
    assert "all_reduce (torch/distributed/distributed_c10d.py" in native, native[:3000]
