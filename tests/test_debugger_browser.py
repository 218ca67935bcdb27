"""A rank's breakpoint() in a real browser: JupyterLab in headless Chromium shows the rank's prompt in the cell, and a
typed `c` finishes the call."""

from __future__ import annotations

from browser import BROWSER_MARKS, Notebook, browser_page

pytestmark = BROWSER_MARKS

CELLS = [
    "from air_magic import distributed",
    """@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def stops():
    import os
    rank = int(os.environ["RANK"])
    secret = 40 + rank
    if rank == 1:
        breakpoint()
    return secret
stops.distributed()""",
]


#: Written into the module's JupyterLab root by the fixture `notebooks` (tests/lab.py).
NOTEBOOKS = {"debugger.ipynb": CELLS}


def test_the_rank_prompt_appears_in_the_cell_and_a_typed_c_finishes_the_call(notebooks):
    """The input box of the cell shows `(Pdb rank 1)`; `p secret` prints the rank's local, `c` returns [40, 41]."""
    with browser_page() as page:
        nb = Notebook(page, notebooks, "debugger.ipynb")
        nb.run(0)
        nb.wait_done(0)
        cell = nb.run(1)
        prompt = cell.locator(".jp-Stdin-prompt", has_text="(Pdb rank 1)")
        prompt.last.wait_for(timeout=180_000)
        box = cell.locator(".jp-Stdin-input").last
        box.fill("p secret")
        box.press("Enter")
        cell.locator(".jp-OutputArea-output", has_text="41").first.wait_for(timeout=60_000)
        cell.locator(".jp-Stdin-prompt", has_text="(Pdb rank 1)").nth(1).wait_for(timeout=60_000)
        box = cell.locator(".jp-Stdin-input").last
        box.fill("c")
        box.press("Enter")
        nb.wait_done(1, timeout=120)
        cell.get_by_text("[40, 41]").wait_for(timeout=30_000)
        nb.screenshot("debugger-continued.png")
