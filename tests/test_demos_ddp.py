"""The DDP demos, executed headless on 2 CPU ranks: through @distributed and through a %%distributed cell."""

from __future__ import annotations

import pytest
from demos_common import assert_loss_goes_down, run_demo

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_ddp_notebook_ships_the_notebooks_model_and_keeps_replicas_identical(demo_dir):
    """The DDP demo: every rank gets the model built in the notebook, the loss goes down, and parameters are identical
    on every rank after training."""
    got = run_demo(
        "ddp.ipynb",
        demo_dir,
        '{"notebook": notebook_params.tolist(), "ranks": [r["rank"] for r in results], '
        '"losses": [r["epoch_losses"] for r in results], '
        '"received": [r["received_params"].tolist() for r in results], '
        '"trained": [r["trained_params"].tolist() for r in results]}',
    )
    assert got["ranks"] == [0, 1]
    for rank, received in enumerate(got["received"]):
        assert received == got["notebook"], f"rank {rank} did not get the notebook's model"
    assert got["trained"][0] == got["trained"][1], "DDP replicas differ after training"
    assert got["trained"][0] != got["notebook"], "training did not change the parameters"
    for rank, losses in enumerate(got["losses"]):
        assert_loss_goes_down(losses, f"rank {rank}")


@pytest.mark.timeout(900)
def test_distributed_magic_notebook_trains_ddp_from_a_cell(demo_dir):
    """The %%distributed demo: a cell using the notebook's class and helper trains DDP on 2 ranks; loss goes down,
    replicas identical."""
    got = run_demo(
        "distributed_magic.ipynb",
        demo_dir,
        '{"ranks": [r["rank"] for r in results], "losses": [r["losses"] for r in results], '
        '"trained": [r["trained_params"].tolist() for r in results]}',
    )
    assert got["ranks"] == [0, 1]
    assert got["trained"][0] == got["trained"][1]
    for rank, losses in enumerate(got["losses"]):
        assert_loss_goes_down(losses, f"rank {rank}")
