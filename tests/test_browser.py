"""The panel in a real browser: JupyterLab in headless Chromium, a real click on Cancel, the record a call leaves."""

from __future__ import annotations

import os
import re
import time
import uuid

import psutil
from browser import BROWSER_MARKS, Notebook, browser_page
from helpers import FLOOD_MB, ROOT, execute_headless
from kernel_watch import KernelWatch
from lab import write_notebook

pytestmark = BROWSER_MARKS

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
    f"""@distributed(num_accelerators=2, accelerator_type="CPU")
def flood():
    import os, sys
    if os.environ["RANK"] == "0":
        block = "".join(f"line {{i:07d}} " + "x" * 86 + "\\n" for i in range(10_000))  # 1 MB
        for _ in range({FLOOD_MB}):
            sys.stdout.write(block)
    print("flood over on rank", os.environ["RANK"])
flood.distributed()""",
]

#: A first call of a kernel that logs metrics and runs until Cancel.
TRAIN_CELLS = [
    "%load_ext air_magic\nfrom air_magic import distributed",
    """@distributed(num_accelerators=2, accelerator_type="CPU")
def train_until_cancelled():
    import math, os, time, mlflow
    r = int(os.environ["RANK"])
    print(f"pid {os.getpid()} training on rank {r}", flush=True)
    for step in range(100_000):
        mlflow.log_metrics({"loss": math.exp(-step / 20) + r / 10, "accuracy": 1 - math.exp(-step / 15)}, step=step)
        if step % 10 == 0:
            print(f"step {step} loss {math.exp(-step / 20):.4f}", flush=True)
        time.sleep(0.1)
train_until_cancelled.distributed()""",
]


#: Written into the module's JupyterLab root by the fixture `notebooks` (tests/lab.py).
NOTEBOOKS = {"panel.ipynb": CELLS}


def _log_text(cell, rank: int) -> str:
    return cell.locator(f".air-magic-log[data-rank='{rank}']").text_content() or ""


def _record(cell) -> str:
    return cell.locator(".air-magic-record").inner_text()


def _gone(pids: list[int]) -> bool:
    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_the_panel_and_a_real_cancel_click_in_jupyterlab(notebooks):
    """Each tab shows its own rank's lines while the call runs; Cancel mid-run stops every process; each call leaves its
    record."""
    with browser_page() as page:
        nb = Notebook(page, notebooks, "panel.ipynb")
        nb.run(0)
        nb.wait_done(0)

        cell = nb.run(1)
        nb.wait_done(1)
        record = cell.locator(".air-magic-record")
        record.wait_for(timeout=30_000)
        ranks = cell.locator(".air-magic-record-rank > summary")
        # each summary may go on with the rank's peak memory: " · peak memory 412 MiB"
        assert [t.strip().split(" · ")[0] for t in ranks.all_inner_texts()] == ["rank 0: done", "rank 1: done"]
        logs = cell.locator(".air-magic-record-log")
        assert "line 2 from rank 0" in logs.nth(0).inner_text() and "stderr of rank 0" in logs.nth(0).inner_text()
        assert "line 2 from rank 1" in logs.nth(1).inner_text() and "from rank 0" not in logs.nth(1).inner_text()
        assert "finished" in _record(cell)
        assert not cell.locator(".air-magic-panel").count(), "the live panel gave way to the record"
        assert "[0, 1]" in cell.inner_text()
        nb.screenshot("panel-two-ranks.png")

        cell = nb.run(2)
        deadline = time.monotonic() + 120
        while not all("pid " in _log_text(cell, r) for r in (0, 1)):
            assert time.monotonic() < deadline, "the ranks never showed their first line"
            time.sleep(0.2)
        tabs = cell.locator(".air-magic-panel .lm-TabBar-tab")
        assert [t.strip() for t in tabs.all_inner_texts()] == ["rank 0: running", "rank 1: running"]
        rank0 = cell.locator(".air-magic-log[data-rank='0']")
        assert rank0.is_visible() and "pid " in rank0.inner_text()
        tabs.filter(has_text="rank 1").click()
        cell.locator(".air-magic-log[data-rank='1']").wait_for(state="visible")
        assert "running" in cell.locator(".air-magic-panel").inner_text()
        pids = [int(p) for r in (0, 1) for p in re.findall(r"pid (\d+) child (\d+)", _log_text(cell, r))[0]]
        nb.screenshot("panel-running.png")
        cell.locator(".air-magic-panel button", has_text="Cancel").click()
        cell.get_by_text("JobCancelledError").wait_for(timeout=30_000)  # how soon after Cancel: bench/faults.py
        nb.wait_done(2)
        gone_by = time.monotonic() + 5
        while not _gone(pids):
            assert time.monotonic() < gone_by, "workers or their children outlived the cancel"
            time.sleep(0.1)
        errors = cell.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        assert "was cancelled" in errors.last.inner_text() and "Traceback" not in cell.inner_text()
        assert [
            t.strip().split(" · ")[0] for t in cell.locator(".air-magic-record-rank > summary").all_inner_texts()
        ] == ["rank 0: stopped", "rank 1: stopped"]
        assert "cancelled" in _record(cell)
        nb.screenshot("panel-cancelled.png")

        cell = nb.run(3)
        cell.get_by_text("next cell ran 42").wait_for(timeout=60_000)
        nb.screenshot("panel-next-cell.png")


def test_a_flood_leaves_the_page_responsive_and_shows_a_bounded_tail(notebooks):
    """While a rank prints FLOOD_MB megabytes the page keeps answering, and the record ends with a note of the lines
    left out."""
    with browser_page() as page:
        nb = Notebook(page, notebooks, "panel.ipynb")
        nb.run(0)
        nb.wait_done(0)
        cell = nb.run(4)
        deadline = time.monotonic() + 300
        while "*" in cell.locator(".jp-InputPrompt").inner_text() or not cell.locator(".air-magic-record").count():
            assert time.monotonic() < deadline, "the flood cell did not finish"
            page.evaluate("1")  # the page answers a script call throughout (how fast: bench/panel_latency.py)
            time.sleep(0.2)
        nb.wait_done(4)
        text = _record(cell)
        assert "flood over on rank 0" in text and "flood over on rank 1" in text
        assert "earlier line(s) not shown" in text and "rank-0.log" in text
        assert len(text) < 64 * 1024
        nb.screenshot("panel-flood.png")


def _box(locator) -> dict:
    """The element's box; the panel redraws its header while a call runs, so a node may be replaced meanwhile."""
    for _ in range(50):
        box = locator.bounding_box()
        if box is not None:
            return box
        time.sleep(0.1)
    raise AssertionError(f"{locator} never had a box")


def _settles_busy(read, ended=lambda: False, within: float = 2.0) -> str:
    """Read a kernel state; one that is not busy must turn busy again within `within` s, unless the call has ended.

    The guarantee (display/busy.py) is that an idle published by a side thread is followed at once by busy for the
    cell: a reader can land between the two (test_panel checks their order message by message). What a user must
    never see is a kernel that stays idle while its cell runs. Returns the first reading that was not busy, or "".
    """
    first = state = read()
    deadline = time.monotonic() + within
    while "busy" not in state.lower() and not ended():
        if time.monotonic() > deadline:
            return f"{first!r}, still {state!r} {within} s later"
        time.sleep(0.05)
        state = read()
    return "" if first == state else f"{first!r} for a moment"


def test_first_call_keeps_the_kernel_busy_shows_at_once_fits_1280_px_and_draws_charts(lab):
    """A kernel's first call: the panel shows at once, the kernel reads busy throughout (server and JupyterLab),
    the header's status line shows whole at 1280 px, metrics are charted live, and Cancel still works mid-cell."""
    name = f"train-{uuid.uuid4().hex[:6]}.ipynb"  # a kernel of its own, first widget included, on a rerun too
    write_notebook(lab.root / name, TRAIN_CELLS)
    with browser_page(1280, 800) as page:
        nb = Notebook(page, lab, name)
        (session,) = [s for s in lab.api("sessions") if s["path"].endswith(name)]
        kernel = session["kernel"]["id"]
        nb.run(0)
        nb.wait_done(0)
        watch = KernelWatch(lab, kernel)  # the server's state every 0.25 s, and every status message it relays
        page.evaluate(STATUS_TEXTS)
        cell = nb.run(1)
        try:
            lab_states = _first_call(page, lab, nb, cell, watch)
        finally:
            _interrupt_if_busy(lab, kernel)  # a failed check leaves no call holding the CPU slots of the next test
    request = watch.request_of("train_until_cancelled.distributed()")
    assert len(watch.during(request)) >= 20 and len(lab_states) >= 5, "too few readings to judge the kernel's state"
    others = watch.others_ended_during(request)
    assert others, "JupyterLab answered nothing mid-call: the check proves nothing"
    # Each of those idles is one the server leaves out of the kernel's state: reading between it and the busy that
    # follows would otherwise see the kernel idle (the server reads one IOPub message per turn of its event loop).
    from jupyter_server.services.kernels.kernelmanager import MappingKernelManager

    untracked = MappingKernelManager().untracked_message_types
    assert all(s[2] in untracked for s in others), f"an idle the server counts was published mid-call: {others}"
    assert not watch.idle_mid_call(request), f"the server saw the kernel idle mid-call: {watch.idle_mid_call(request)}"
    assert not any("still" in s for s in lab_states), f"JupyterLab showed the kernel idle mid-call: {lab_states}"


#: Every text a panel's status line shows, in order, kept by the page itself (a MutationObserver): a phase shown for a
#: moment is seen however late the test reads the page.
STATUS_TEXTS = """() => { window.amStatus = [];
  new MutationObserver(() => { for (const e of document.querySelectorAll('.air-magic-status')) {
    const t = e.innerText; if (t && window.amStatus[window.amStatus.length - 1] !== t) window.amStatus.push(t); } })
  .observe(document.body, {subtree: true, childList: true, characterData: true}); }"""


def _interrupt_if_busy(lab, kernel: str) -> None:
    """Interrupt the kernel if it still runs a cell, and wait until it is idle."""
    deadline = time.monotonic() + 60
    while lab.api(f"kernels/{kernel}")["execution_state"] != "idle" and time.monotonic() < deadline:
        lab.api(f"kernels/{kernel}/interrupt", "POST")
        time.sleep(1)


def _first_call(page, lab, nb, cell, watch) -> list[str]:
    """The checks of the first call's panel while it runs, then Cancel; what JupyterLab's status bar read meanwhile."""
    cell.locator(".air-magic-panel").wait_for(timeout=30_000)  # how soon: bench/panel_latency.py
    deadline = time.monotonic() + 120
    while not any("running" in t for t in page.evaluate("window.amStatus")):
        assert time.monotonic() < deadline, f"the call never read running: {page.evaluate('window.amStatus')}"
        time.sleep(0.1)
    shown = page.evaluate("window.amStatus")
    first_running = next(i for i, t in enumerate(shown) if "running" in t)
    assert any("starting" in t for t in shown[:first_running]), f"the panel showed after the ranks started: {shown}"

    def lab_state() -> str:
        return page.locator(".jp-StatusBar-Widget", has_text="Python 3").first.inner_text()

    lab_states = []
    charts = cell.locator(".air-magic-chart")
    cancel = cell.locator(".air-magic-panel button.air-magic-cancel")
    deadline = time.monotonic() + 120
    while charts.count() < 2 or "step 20" not in _log_text(cell, 1):
        assert time.monotonic() < deadline, "no charts or no lines within 120 s"
        lab_states.append(_settles_busy(lab_state))
        time.sleep(0.1)
    # the header: the status line whole on a row of its own (nothing cut off), the link (short text, the URL on
    # hover) and the buttons in one row under it, each button's label whole
    header, status = cell.locator(".air-magic-header"), cell.locator(".air-magic-status")
    line = status.locator(".air-magic-phase").evaluate("e => parseFloat(getComputedStyle(e).lineHeight) || 20")
    assert _box(status)["height"] < 1.5 * line, "the status wraps at 1280 px"
    shown_whole = "e => { const d = e.firstElementChild; return d.scrollWidth <= d.clientWidth + 1; }"
    assert status.evaluate(shown_whole), f"the status line is cut: {status.inner_text()!r}"
    assert _box(status)["x"] + _box(status)["width"] <= _box(header)["x"] + _box(header)["width"] + 1
    buttons = [_box(cell.locator(f".air-magic-panel button.{c}")) for c in ("air-magic-stop", "air-magic-cancel")]
    assert abs(buttons[0]["y"] - buttons[1]["y"]) < 2, "the buttons are not in one row"
    assert buttons[0]["y"] >= _box(status)["y"] + _box(status)["height"] - 1, "the buttons are not under the status"
    link = cell.locator(".air-magic-link a")
    assert re.fullmatch(r"run [0-9a-f]{8}", link.inner_text().strip()), link.inner_text()
    assert "/runs/" in link.get_attribute("title") and link.get_attribute("title") == link.get_attribute("href")
    for label in ("Cancel", "Cancelling…", "Cancelled"):  # every label the button shows fits it whole
        fits = cancel.evaluate(
            """(b, label) => { const c = b.cloneNode(true);
               const t = [...c.childNodes].find(n => n.nodeType === 3) || c;
               t.textContent = label; c.style.position = 'absolute'; c.style.visibility = 'hidden';
               b.parentNode.appendChild(c); const ok = c.scrollWidth <= b.clientWidth + 1;
               c.remove(); return ok; }""",
            label,
        )
        assert fits, f"the Cancel button cuts {label!r}"
    assert cancel.evaluate("b => b.scrollWidth <= b.clientWidth + 1")
    page.wait_for_timeout(600)
    # The README's docs/panel.png is refreshed only when asked, so a test run leaves the checkout as it was.
    shot = ROOT / "docs" / "panel.png" if os.environ.get("AIR_MAGIC_UPDATE_SCREENSHOT") else lab.root / "panel.png"
    shot.parent.mkdir(exist_ok=True)
    cell.locator(".air-magic-panel").screenshot(path=str(shot))
    assert shot.stat().st_size > 0
    text = cell.locator(".air-magic-charts").inner_text()
    assert "loss" in text and "accuracy" in text and "rank 0:" in text and "rank 1:" in text
    pids = [int(p) for r in (0, 1) for p in re.findall(r"pid (\d+) training", _log_text(cell, r))]
    cancel.click()
    while not cell.locator(".air-magic-record").count():
        assert time.monotonic() < deadline, "Cancel did not end the call"
        time.sleep(0.1)
    nb.wait_done(1)
    watch.close()
    assert _gone(pids)
    assert "JobCancelledError" in cell.inner_text()
    assert "cancelled" in _record(cell) and cell.locator(".air-magic-record .air-magic-chart").count() == 2
    return lab_states


def test_a_saved_notebook_shows_its_record_without_a_kernel(lab, tmp_path):
    """A notebook executed headless and reopened in JupyterLab with no kernel shows every call's record."""
    import nbformat

    nb = execute_headless(
        CELLS[:2], tmp_path, {"AIR_MAGIC_RUNS_DIR": str(lab.root / "runs"), "AIR_MAGIC_DISPLAY": "panel"}
    )
    nb.metadata.pop("kernelspec", None)  # nothing to start: the page is all there is
    nb.metadata.pop("language_info", None)
    nbformat.write(nb, lab.root / "saved.ipynb")
    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    with browser_page() as page:
        page.goto(lab.url("saved.ipynb"))
        dialog = page.locator(".jp-Dialog")
        dialog.wait_for(timeout=120_000)  # JupyterLab asks which kernel to start
        page.screenshot(path=str(ROOT / "test-artifacts" / "saved-dialog.png"))
        if dialog.locator("select").count():
            dialog.locator("select").select_option(label="No Kernel")
            dialog.get_by_role("button", name="Select").click()
        else:
            dialog.get_by_role("button", name="No Kernel").click()
        record = page.locator(".air-magic-record")
        record.wait_for(timeout=60_000)
        text = record.inner_text()
        assert "finished" in text and "line 2 from rank 0" in text and "line 2 from rank 1" in text
        assert "stderr of rank 1" in text
        assert "Error displaying widget" not in page.inner_text("body")
        assert not [s for s in lab.api("sessions") if s["path"].endswith("saved.ipynb")], "no kernel was started"
        page.screenshot(path=str(ROOT / "test-artifacts" / "saved-record.png"), full_page=True)
