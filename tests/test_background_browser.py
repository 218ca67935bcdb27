"""A background call's panel in a real browser: after a page reload, `%distributed_show` draws it again, live."""

from __future__ import annotations

import re
import time

from browser import BROWSER_MARKS, Notebook, browser_page
from lab import write_notebook

pytestmark = BROWSER_MARKS


def _cells(flag: str) -> list[str]:
    return [
        f"""%load_ext air_magic
from air_magic import distributed

@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def ticker(flag):
    import os, pathlib, time
    rank, tick = os.environ["RANK"], 0
    while not pathlib.Path(flag).exists():
        print(f"tick {{tick}} from rank {{rank}}", flush=True)
        tick += 1
        time.sleep(0.2)
    return tick

h = ticker.spawn({flag!r})""",
        "%distributed_show",
        "print(h.status)",
    ]


def _ticks(text: str) -> int:
    found = [int(n) for n in re.findall(r"tick (\d+) from rank 0", text)]
    return max(found) if found else -1


def test_after_a_reload_distributed_show_draws_the_live_panel_whose_lines_keep_coming(lab):
    """The spawning cell returns at once; after the page is reloaded, %distributed_show in another cell shows the
    lines written before it and then new ones as they come; when the call ends that panel becomes its record."""
    flag = lab.root / "go-background"
    write_notebook(lab.root / "background.ipynb", _cells(str(flag)))
    with browser_page() as page:
        nb = Notebook(page, lab, "background.ipynb")
        nb.run(0)
        nb.wait_done(0)
        time.sleep(1)  # let the ranks write a few lines before the page goes
        nb = Notebook(page, lab, "background.ipynb")  # a reload: a new page on the same kernel
        cell = nb.run(1)
        nb.wait_done(1)
        log = cell.locator(".air-magic-panel .air-magic-log[data-rank='0']")
        try:
            log.wait_for(timeout=60_000)
        except Exception:
            nb.screenshot("background-show-no-panel.png")
            raise
        deadline = time.monotonic() + 120
        while _ticks(log.text_content() or "") < 0:
            assert time.monotonic() < deadline, "the panel never showed rank 0's lines"
            time.sleep(0.2)
        first = _ticks(log.text_content() or "")
        while _ticks(log.text_content() or "") < first + 5:
            assert time.monotonic() < deadline, f"no new lines came after tick {first}"
            time.sleep(0.2)
        assert "tick 0 from rank 0" in (log.text_content() or ""), "the lines written before the panel are there"
        nb.screenshot("background-show-after-reload.png")
        flag.touch()
        cell.locator(".air-magic-record").wait_for(timeout=120_000)
        assert "finished" in cell.locator(".air-magic-record").inner_text()
        nb.run(2)
        nb.wait_done(2)
        assert "finished" in nb.cell(2).inner_text()
