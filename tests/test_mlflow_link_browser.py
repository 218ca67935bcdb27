"""The MLflow link of a call made under a real Jupyter server opens the run in headless Chromium, through Jupyter."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from browser import CHROMIUM, browser_page

pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:websocket"),
]
import playwright.sync_api  # noqa: F401 - required: a missing install fails here, not as a skip
import websocket  # noqa: F401


def ui_processes(root: Path) -> set[int]:
    """MLflow UIs over the store in `root` (other checkouts may run their own meanwhile)."""
    found = set()
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline())
            if re.search(r"-m mlflow server\b", cmd) and str(root) in cmd and p.status() != psutil.STATUS_ZOMBIE:
                found.add(p.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (make browser)")
def test_link_opens_the_run_with_its_metric_through_jupyter(lab):
    """Under Jupyter the link goes through Jupyter's authenticated proxy and opens the run, with its metric, in MLflow's
    training view."""
    ui_before = ui_processes(lab.root)
    kernel = lab.api("kernels", "POST", {"name": "python3"})["id"]
    try:
        out = lab.execute(
            kernel,
            """
from air_magic import distributed
from air_magic.tracking import ui as mlflow_ui
@distributed(num_accelerators=2, accelerator_type="CPU")
def train():
    import os, mlflow
    for step in range(3):
        mlflow.log_metric("loss", 0.5 / (step + 1) + int(os.environ["RANK"]), step=step)
train.distributed()
for ui in mlflow_ui._uis.values():
    mlflow_ui.wait_ready(ui)
""",
        )
        link = re.search(r"MLflow run: (\S+)", out).group(1)
        assert link.startswith("/proxy/absolute/"), f"under Jupyter the link goes through Jupyter: {link}"
        assert link.endswith("?workflowType=machine_learning"), link
        run_id = link.split("?")[0].rsplit("/", 1)[-1]

        # Without Jupyter's credentials the proxy refuses, or sends the browser to Jupyter's login page.
        try:
            with urllib.request.urlopen(lab.base + link.split("#")[0], timeout=30) as anonymous:
                assert "/login" in anonymous.geturl(), f"the proxy served {anonymous.geturl()} without a login"
        except urllib.error.HTTPError as refused:
            assert refused.code in (401, 403)

        with browser_page(headers={"Authorization": f"token {lab.token}"}) as page:
            page.goto(lab.base + link, timeout=120_000)
            page.get_by_text("loss", exact=True).first.wait_for(timeout=120_000)
            body = page.inner_text("body")
            assert "train" in body, "the run's name is on the page"
            assert "loss" in body
            assert "Evaluation runs" not in body, "the run opens in the model-training view, not the GenAI one"
            seen = page.request.get(lab.base + link.split("#")[0] + f"ajax-api/2.0/mlflow/runs/get?run_id={run_id}")
            keys = [m["key"] for m in seen.json()["run"]["data"]["metrics"]] if seen.ok else []
            assert seen.ok and [k for k in keys if not k.startswith("system/")] == ["loss"]
    finally:
        lab.api(f"kernels/{kernel}", "DELETE")
    deadline = time.monotonic() + 40
    while ui_processes(lab.root) - ui_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ui_processes(lab.root) - ui_before, "the local MLflow UI outlived its kernel"
