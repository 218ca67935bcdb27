"""Training frameworks users bring, unchanged, on 2 CPU ranks of a real kernel: accelerate, Lightning, Hugging Face."""

from __future__ import annotations

import pytest

#: Real kernels and processes; each framework's import costs its ranks seconds.
pytestmark = pytest.mark.slow

SETUP = """
from air_magic import distributed
import torch
from torch.utils.data import DataLoader, TensorDataset

def data():
    torch.manual_seed(0)
    return TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
"""


@pytest.fixture(scope="module")
def nb(kernel):
    kernel.execute(SETUP).check()
    return kernel


def test_a_plain_accelerator_sees_every_rank_and_splits_the_batches(nb):
    """`Accelerator()` as accelerate's docs write it runs as 2 CPU processes, each training on half the batches."""
    nb.execute(
        """
@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def train():
    from accelerate import Accelerator
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data(), batch_size=2))
    batches = 0
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        batches += 1
    state = accelerator.state
    return (state.num_processes, state.process_index, state.distributed_type.value, batches)
"""
    ).check()
    out = nb.execute("train.distributed()").check()
    assert out.result == "[(2, 0, 'MULTI_CPU', 4), (2, 1, 'MULTI_CPU', 4)]"


LIGHTNING = """
import lightning as L

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.batches = 0
    def training_step(self, batch, batch_idx):
        self.batches += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def fit(**devices):
    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **devices,
    )
    model = Regression()
    trainer.fit(model, DataLoader(data(), batch_size=2))
    return (trainer.world_size, trainer.global_rank, model.batches)
"""


def test_a_lightning_trainer_with_ddp_trains_on_both_ranks(nb):
    """Lightning's `Trainer(accelerator="cpu", strategy="ddp", devices=2)` trains as a world of 2, 4 batches each."""
    nb.execute(LIGHTNING).check()
    out = nb.execute("fit.distributed(devices=2)").check()
    assert out.result == "[(2, 0, 4), (2, 1, 4)]"


def test_a_lightning_trainer_without_devices_gets_lightnings_own_error(nb):
    """Left out, `devices` (1 on CPU) does not match the world of 2: Lightning's own ValueError, as under torchrun."""
    out = nb.execute("fit.distributed()")
    assert out.ename == "ValueError", out.traceback
    assert "does not match the world size (2)" in out.traceback


def test_lightning_fabric_runs_as_two_processes(nb):
    """Lightning `Fabric(accelerator="cpu", strategy="ddp", devices=2)`, launched in the ranks, sums over both."""
    nb.execute(
        """
@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def fabric_sum():
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum")
    return (fabric.world_size, fabric.global_rank, total.item())
"""
    ).check()
    out = nb.execute("fabric_sum.distributed()").check()
    assert out.result == "[(2, 0, 3.0), (2, 1, 3.0)]"


def test_a_hugging_face_trainer_trains_a_tiny_model_on_both_ranks(nb, workdir):
    """The Hugging Face `Trainer` (a tiny GPT-2 from a config, nothing downloaded) trains with a world size of 2."""
    nb.execute(
        f"""
@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def hf_train():
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)
    model = GPT2LMHeadModel(config)
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (16, 8))
    rows = [{{"input_ids": row, "labels": row}} for row in ids]
    args = TrainingArguments(
        output_dir={str(workdir / "hf")!r}, per_device_train_batch_size=2, num_train_epochs=1,
        report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return (args.world_size, args.process_index, trainer.state.global_step)
"""
    ).check()
    out = nb.execute("hf_train.distributed()", timeout=240).check()
    assert out.result == "[(2, 0, 4), (2, 1, 4)]"
