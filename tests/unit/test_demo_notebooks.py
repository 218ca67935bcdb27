"""The demo notebooks as files: each picks its backend in one visible line and is saved without outputs."""

from __future__ import annotations

import json
from pathlib import Path

DEMOS = Path(__file__).resolve().parents[2] / "demo_notebooks"


def test_every_demo_picks_its_backend_in_one_visible_line_and_says_so():
    """Each notebook's first cell says NCCL on GPUs and gloo on CPU, and its code picks the backend in one line."""
    line = 'backend = "nccl" if torch.cuda.is_available() else "gloo"'
    notebooks = sorted(DEMOS.glob("*.ipynb"))
    assert {p.name for p in notebooks} >= {
        "quickstart.ipynb",
        "ddp.ipynb",
        "fsdp.ipynb",
        "deepspeed.ipynb",
        "distributed_magic.ipynb",
    }
    for path in notebooks:
        nb = json.loads(path.read_text())
        first = "".join(nb["cells"][0]["source"])
        assert nb["cells"][0]["cell_type"] == "markdown" and "NCCL on GPUs" in first and "gloo on CPU" in first, path
        code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        assert code.count(line) == 1, f"{path.name}: the backend line should appear exactly once"
        assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), f"{path.name} has outputs"


def test_every_demo_notebook_has_an_id_on_each_cell_and_no_outputs():
    """nbformat warns about (and will refuse) a cell without an id in a notebook of format 4.5 or later; every demo
    is stored clean, without outputs."""
    for path in sorted(DEMOS.glob("**/*.ipynb")):
        if "executed" in path.parts:
            continue
        raw = json.loads(path.read_text())
        missing = [i for i, cell in enumerate(raw["cells"]) if "id" not in cell]
        assert not missing, f"{path.name}: cells {missing} have no id (nbformat.validator.normalize adds them)"
        assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5), f"{path.name}: format before cell ids"
        assert all(not cell.get("outputs") for cell in raw["cells"]), f"{path.name} is stored with outputs"
