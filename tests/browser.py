"""Headless Debian Chromium driven by Playwright, for the tests that look at JupyterLab as a user does.

`browser_page` drives Debian's Chromium (/usr/bin/chromium) through Playwright; no browser is downloaded.
`Notebook` runs cells of a notebook open in a `Lab` (lab.py) by keyboard, as a user would. `BROWSER_MARKS` are the
marks of a module that needs the browser.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT
from lab import Lab

CHROMIUM = "/usr/bin/chromium"
#: The marks of a test module that drives JupyterLab in headless Chromium.
BROWSER_MARKS = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="needs Debian's chromium (make browser)"),
]
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = ROOT / "test-artifacts"


@contextmanager
def browser_page(width: int = 1280, height: int = 900, headers: dict[str, str] | None = None) -> Iterator[Any]:
    """A Playwright page in headless Debian Chromium (sending `headers` with every request, if given)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": width, "height": height}, extra_http_headers=headers)
            page = context.new_page()
            yield page
        finally:
            browser.close()


class Notebook:
    """A notebook open in JupyterLab, driven by keyboard and mouse."""

    def __init__(self, page: Any, lab: Lab, name: str) -> None:
        self.page = page
        page.goto(lab.url(name))
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        # ready when the server has the notebook's kernel idle and the page has connected to it
        deadline = time.monotonic() + 120
        while True:
            sessions = [s for s in lab.api("sessions") if s["path"].endswith(name)]
            if sessions and sessions[0]["kernel"]["execution_state"] == "idle":
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kernel of {name} never became idle")
            time.sleep(0.3)
        page.locator(".jp-StatusBar-Widget", has_text="Idle").first.wait_for(timeout=60_000)

    def cell(self, index: int) -> Any:
        return self.page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell").nth(index)

    def run(self, index: int) -> Any:
        """Start cell `index` (Shift+Enter in its editor) and return its locator."""
        cell = self.cell(index)
        cell.locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Shift+Enter")
        return cell

    def wait_done(self, index: int, timeout: float = 120) -> Any:
        """Wait until cell `index` shows an execution count (not '*')."""
        cell = self.cell(index)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            prompt = cell.locator(".jp-InputPrompt").inner_text().strip()
            if prompt and "*" not in prompt and prompt != "[ ]:":
                return cell
            time.sleep(0.2)
        shot = self.screenshot(f"timeout-cell-{index}.png")
        raise TimeoutError(f"cell {index} did not finish in {timeout} s; screenshot: {shot}")

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=True)
        return path
