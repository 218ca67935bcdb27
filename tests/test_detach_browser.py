"""A detached call in a real browser: its kernel is killed with SIGKILL, a new notebook attaches to it and its panel
shows the lines written before the kill and the new ones as they come; Stop in that panel reaches the ranks and
Cancel ends the call."""

from __future__ import annotations

import os
import re
import signal

import psutil
from browser import BROWSER_MARKS, Notebook, browser_page
from helpers import wait_until
from lab import write_notebook

from air_magic.calls import record as call_record

pytestmark = BROWSER_MARKS

SPAWN = """%load_ext air_magic
import os
from air_magic import distributed

@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False, detach=True)
def ticker():
    import os, time
    import air_magic
    rank, seen = os.environ["RANK"], False
    for tick in range(240):  # about two minutes: Cancel ends it long before
        if not seen and air_magic.should_stop():  # Stop is seen, and the loop goes on so that Cancel ends it
            seen = True
            print(f"stop seen on rank {rank}", flush=True)
        print(f"tick {tick} from rank {rank}", flush=True)
        time.sleep(0.5)
    return rank

h = ticker.spawn()
print("KERNEL", os.getpid(), "ID", h.id)"""


def _ticks(text: str, rank: int = 0) -> int:
    found = [int(n) for n in re.findall(rf"tick (\d+) from rank {rank}", text)]
    return max(found) if found else -1


def test_attach_in_jupyterlab_after_the_first_kernel_was_killed_shows_old_and_new_lines_and_cancels(lab):
    """Kernel 1 spawns a detached call and is killed with SIGKILL; in another notebook %distributed_attach draws the
    live panel with rank 0's lines from before the kill, new lines arrive in it, its Stop reaches the ranks
    (`should_stop()`) and its Cancel ends the call."""
    write_notebook(lab.root / "spawn.ipynb", [SPAWN])
    with browser_page() as page:
        nb = Notebook(page, lab, "spawn.ipynb")
        cell = nb.run(0)
        nb.wait_done(0)
        found = re.search(r"KERNEL (\d+) ID (\S+)", cell.inner_text())
        assert found, cell.inner_text()
        kernel_pid, call_id = int(found[1]), found[2]
        run_dir = lab.root / "runs" / call_id
        log = run_dir / "rank-0.log"
        try:
            wait_until(lambda: log.exists() and _ticks(log.read_text()) >= 2, 180, "rank 0 never printed its ticks")
            os.kill(kernel_pid, signal.SIGKILL)
            psutil.Process(kernel_pid).wait(30) if psutil.pid_exists(kernel_pid) else None
            before = _ticks(log.read_text())
            record = call_record.load(run_dir)
            assert record is not None and record["status"] == "running", record

            write_notebook(lab.root / "attach.ipynb", [f"%load_ext air_magic\n%distributed_attach {call_id}"])
            nb = Notebook(page, lab, "attach.ipynb")  # a new page, a new kernel
            cell = nb.run(0)
            nb.wait_done(0)
            panel = cell.locator(".air-magic-panel")
            try:
                panel.wait_for(timeout=60_000)
            except Exception:
                nb.screenshot("attach-no-panel.png")
                raise
            rank0 = cell.locator(".air-magic-log[data-rank='0']")

            def shown() -> str:
                return rank0.text_content() or ""

            wait_until(
                lambda: "tick 0 from rank 0" in shown(), 60, f"the panel lacks the first lines: {shown()[:300]!r}"
            )
            assert "tick 0 from rank 0" in shown() and f"tick {before} from rank 0" in shown()
            wait_until(lambda: _ticks(shown()) > before + 2, 60, "no new line reached the attached panel")
            ticked = _ticks(shown())  # each tick takes 0.5 s or more: the call has run for ticked / 2 s at least
            status = cell.locator(".air-magic-status").inner_text()
            clock = re.search(r"running · (\d+) s", status)
            assert clock and int(clock[1]) >= ticked // 2 - 2, (
                f"the clock does not count from the call's start: {status!r}"
            )
            nb.screenshot("attach-live.png")

            panel.locator("button.air-magic-stop").click()
            wait_until(
                lambda: "stop seen on rank 0" in shown(), 60, "Stop in the attached panel did not reach the ranks"
            )

            panel.locator("button.air-magic-cancel").click()
            wait_until(
                lambda: (call_record.load(run_dir) or {}).get("status") == call_record.CANCELLED,
                60,
                f"Cancel in the attached panel did not end the call: {call_record.load(run_dir)}",
            )
            record_box = cell.locator(".air-magic-record")
            record_box.wait_for(timeout=30_000)
            assert "cancelled" in record_box.inner_text()
            nb.screenshot("attach-cancelled.png")
            owner = (call_record.load(run_dir) or {}).get("owner", {}).get("pid")
            wait_until(lambda: not owner or not psutil.pid_exists(owner), 60, "the call's owner outlived the cancel")
        finally:  # whatever failed above, the detached call does not outlive the test
            if (call_record.load(run_dir) or {}).get("status") in call_record.LIVE:
                call_record.request_cancel(run_dir)
                owner = (call_record.load(run_dir) or {}).get("owner", {}).get("pid")
                wait_until(
                    lambda: not owner or not psutil.pid_exists(owner), 60, "the call's owner outlived its cancel"
                )
