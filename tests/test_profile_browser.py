"""The panel's Profile button in a real browser: JupyterLab in headless Chromium, a real click while a DDP call runs,
the table in the panel's Profile tab, then Stop and the record that keeps it."""

from __future__ import annotations

import os
import time

from browser import BROWSER_MARKS, Notebook, browser_page
from helpers import ROOT
from lab import write_notebook

pytestmark = BROWSER_MARKS

CELLS = [
    "%load_ext air_magic\nfrom air_magic import distributed",
    """@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def train():
    import torch, torch.distributed as dist, air_magic
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(nn.Linear(256, 256))
    x, w = torch.randn(64, 256), torch.randn(256, 256)
    print(f"training on rank {rank}", flush=True)
    step = 0
    while step < 20_000:
        stop = torch.tensor([float(air_magic.should_stop())])
        dist.all_reduce(stop)  # every rank stops at the same step
        if stop.item():
            break
        y = model(x)
        for _ in range(150 if rank == 1 else 0):  # rank 1 does ~20 ms more work a step, more than load costs rank 0
            y = y + (x @ w) * 0
        y.sum().backward()
        air_magic.step()
        step += 1
    dist.destroy_process_group()
    return step
train.distributed()""",
]


def test_a_profile_click_shows_every_ranks_table_and_the_record_keeps_it(lab):
    """A real click on Profile while the call runs shows the table (rank 1 the slowest, by its compute, and last at
    the collectives of the same steps) in the Profile tab, after the ranks' tabs and in front; after Stop, the
    record holds it."""
    write_notebook(lab.root / "profile.ipynb", CELLS)
    with browser_page() as page:
        nb = Notebook(page, lab, "profile.ipynb")
        nb.run(0)
        nb.wait_done(0)
        cell = nb.run(1)
        logs = [cell.locator(f".air-magic-log[data-rank='{r}']") for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not all("training on rank" in (log.text_content() or "") for log in logs if log.count()) or not all(
            log.count() for log in logs
        ):
            assert time.monotonic() < deadline, "the ranks never started training"
            time.sleep(0.2)
        cell.locator(".air-magic-panel button.air-magic-profile-button").click()
        view = cell.locator(".air-magic-panel .air-magic-profile")
        while "collective ms" not in (view.inner_text() if view.count() else ""):
            assert time.monotonic() < deadline, "the profile never showed"
            time.sleep(0.2)
        shown = view.inner_text()
        titles = cell.locator(".air-magic-panel .lm-TabBar-tab").all_inner_texts()
        assert titles[-1].strip() == "Profile" and len(titles) == 3, titles
        selected = cell.locator(".air-magic-panel .lm-TabBar-tab.lm-mod-current").inner_text()
        assert selected.strip() == "Profile", selected
        assert "slowest: rank 1 (compute" in shown and "rank 1 arrives last" in shown, shown  # the same steps
        page.wait_for_timeout(300)
        # docs/profiling.png is refreshed only when asked, so a test run leaves the checkout as it was
        shot = ROOT / "docs" / "profiling.png" if os.environ.get("AIR_MAGIC_UPDATE_SCREENSHOT") else lab.root / "p.png"
        cell.locator(".air-magic-panel").screenshot(path=str(shot))
        cell.locator(".air-magic-panel button.air-magic-stop").click()
        nb.wait_done(1)
        record = cell.locator(".air-magic-record")
        record.wait_for(timeout=30_000)
        assert "profiled 5 step(s)" in record.inner_text()
        assert cell.locator(".air-magic-record .air-magic-record-profile").count() == 1
