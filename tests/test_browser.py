"""The panel in a real browser: JupyterLab in headless Chromium, a real click on Cancel."""

from __future__ import annotations

import re
import shutil
import time

import psutil
import pytest

from lab import CHROMIUM, Lab, Notebook, browser_page, write_notebook

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="needs Debian's chromium (make browser)"),
]

CELLS = [
    "from air_magic import distributed",
    """@distributed(num_accelerators=2, accelerator_type="CPU")
def hello():
    import os, sys
    r = int(os.environ["RANK"])
    for i in range(3):
        print(f"line {i} from rank {r}")
    print(f"stderr of rank {r}", file=sys.stderr)
    return r
hello.distributed()""",
    """@distributed(num_accelerators=2, accelerator_type="CPU")
def forever():
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"pid {os.getpid()} child {child.pid}", flush=True)
    while True:
        time.sleep(0.2)
forever.distributed()""",
    "print('next cell ran', 6 * 7)",
    """@distributed(num_accelerators=2, accelerator_type="CPU")
def flood():
    import os, sys
    if os.environ["RANK"] == "0":
        block = "".join(f"line {i:07d} " + "x" * 86 + "\\n" for i in range(10_000))  # 1 MB
        for _ in range(200):
            sys.stdout.write(block)
    print("flood over on rank", os.environ["RANK"])
flood.distributed()""",
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    (root / "runs").mkdir()
    write_notebook(root / "panel.ipynb", CELLS)
    server = Lab(root, env={"AIR_MAGIC_RUNS_DIR": str(root / "runs"), "AIR_MAGIC_DISPLAY": "auto"})
    yield server
    server.close()


def _log_text(cell, rank: int) -> str:
    return cell.locator(f".air-magic-log[data-rank='{rank}']").text_content() or ""


def test_the_panel_and_a_real_cancel_click_in_jupyterlab(lab):
    """Both tabs show their own rank's lines; clicking Cancel mid-run stops every process and the next cell runs."""
    with browser_page() as page:
        nb = Notebook(page, lab, "panel.ipynb")
        nb.run(0)
        nb.wait_done(0)

        cell = nb.run(1)
        nb.wait_done(1)
        tabs = cell.locator(".air-magic-panel .lm-TabBar-tab")
        tabs.filter(has_text="rank 1: done").wait_for(timeout=30_000)
        assert [t.strip() for t in tabs.all_inner_texts()] == ["rank 0: done", "rank 1: done"]
        rank0 = cell.locator(".air-magic-log[data-rank='0']")
        assert rank0.is_visible() and "line 2 from rank 0" in rank0.inner_text()
        assert "stderr of rank 0" in rank0.inner_text() and "from rank 1" not in rank0.inner_text()
        tabs.filter(has_text="rank 1").click()
        rank1 = cell.locator(".air-magic-log[data-rank='1']")
        rank1.wait_for(state="visible")
        assert "line 2 from rank 1" in rank1.inner_text() and "from rank 0" not in rank1.inner_text()
        assert "[1]" in cell.locator(".jp-OutputArea-output").last.inner_text() or "[0, 1]" in cell.inner_text()
        nb.screenshot("panel-two-ranks.png")

        cell = nb.run(2)
        deadline = time.monotonic() + 120
        while not all("pid " in _log_text(cell, r) for r in (0, 1)):
            assert time.monotonic() < deadline, "the ranks never showed their first line"
            time.sleep(0.2)
        assert "running" in cell.locator(".air-magic-panel").inner_text()
        pids = [int(p) for r in (0, 1) for p in re.findall(r"pid (\d+) child (\d+)", _log_text(cell, r))[0]]
        nb.screenshot("panel-running.png")
        clicked = time.monotonic()
        cell.locator(".air-magic-panel button", has_text="Cancel").click()
        cell.get_by_text("JobCancelledError").wait_for(timeout=30_000)
        ended = time.monotonic()
        nb.wait_done(2)
        assert ended - clicked < 5.0
        gone_by = time.monotonic() + 5
        while [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
            assert time.monotonic() < gone_by, "workers or their children outlived the cancel"
            time.sleep(0.1)
        errors = cell.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        assert "was cancelled" in errors.last.inner_text() and "Traceback" not in cell.inner_text()
        assert [t.strip() for t in cell.locator(".lm-TabBar-tab").all_inner_texts()] == [
            "rank 0: stopped", "rank 1: stopped"
        ]
        nb.screenshot("panel-cancelled.png")

        cell = nb.run(3)
        cell.get_by_text("next cell ran 42").wait_for(timeout=60_000)
        nb.screenshot("panel-next-cell.png")


def test_a_200_mb_flood_leaves_the_page_responsive_and_shows_a_bounded_tail(lab):
    """While a rank prints 200 MB the page keeps answering, and the tab ends with a note of the lines left out."""
    with browser_page() as page:
        nb = Notebook(page, lab, "panel.ipynb")
        nb.run(0)
        nb.wait_done(0)
        cell = nb.run(4)
        slowest = 0.0
        deadline = time.monotonic() + 300
        while "*" in cell.locator(".jp-InputPrompt").inner_text() or not cell.locator(".air-magic-log").count():
            assert time.monotonic() < deadline, "the flood cell did not finish"
            t0 = time.monotonic()
            page.evaluate("1")
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.2)
        nb.wait_done(4)
        log = cell.locator(".air-magic-log[data-rank='0']")
        log.get_by_text("flood over on rank 0").wait_for(timeout=30_000)
        text = log.inner_text()
        assert "earlier line(s) not shown" in text and "rank-0.log" in text
        assert len(text) < 64 * 1024
        assert slowest < 5.0, f"the page stopped answering for {slowest:.1f} s"
        nb.screenshot("panel-flood.png")
