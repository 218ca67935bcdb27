"""JupyterLab in headless Chromium, for tests and benchmarks that need a real browser.

`Lab` starts one JupyterLab server on 127.0.0.1 with a random token in a
private root directory (its own settings, so no news or update pop-ups), with
the project's jupyter-config/ on its config path (the MLflow proxy route) and
air_magic importable by its kernels; its environment comes from
helpers.process_env. The `lab` fixture starts one per test module (tests/conftest.py registers
this module's fixtures). `browser_page` drives Debian's Chromium
(/usr/bin/chromium) through Playwright; no browser is downloaded. `Notebook`
runs cells by keyboard, as a user would; `Lab.execute` runs code in a kernel
over the server's websocket, as a frontend does.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import ROOT, process_env

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_notebook(path: Path, cells: list[str]) -> Path:
    """A notebook of code cells with the python3 kernel."""
    nb = {
        "cells": [
            {"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [], "source": src}
            for i, src in enumerate(cells)
        ],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))
    return path


class Lab:
    """A JupyterLab server on 127.0.0.1 with a token, serving `root`; kernels get `env` on top of process_env()."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        settings = root / ".lab-settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False})
        )
        (root / "runs").mkdir(exist_ok=True)
        extra = {"AIR_MAGIC_RUNS_DIR": str(root / "runs"), "AIR_MAGIC_DISPLAY": "auto"}
        extra.update(env or {})
        full_env = process_env(extra)
        full_env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(
            p for p in [str(ROOT / "jupyter-config"), os.environ.get("JUPYTER_CONFIG_PATH", "")] if p
        )
        full_env["JUPYTERLAB_SETTINGS_DIR"] = str(root / ".lab-settings")
        full_env["JUPYTERLAB_WORKSPACES_DIR"] = str(root / ".lab-workspaces")
        full_env["JUPYTER_RUNTIME_DIR"] = str(root / ".runtime")
        self.log = open(root / "jupyterlab.log", "wb")  # noqa: SIM115 - open as long as the server runs
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={root}",
                "--allow-root",
            ],
            cwd=root,
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, notebook: str) -> str:
        # reset: open only this notebook, not the tabs an earlier page of the same server left in its workspace
        return f"{self.base}/lab/tree/{notebook}?reset&token={self.token}"

    def api(self, path: str, method: str = "GET", body: dict | None = None) -> Any:
        """Call the server's REST API (`path` after /api/) with the token; the decoded JSON answer."""
        req = urllib.request.Request(
            f"{self.base}/api/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def execute(self, kernel_id: str, code: str, timeout: float = 300) -> str:
        """Run `code` in a kernel over the server's websocket, as a frontend does.

        Returns its stdout followed by the text/plain of what it displayed; raises on an error.
        """
        import uuid

        import websocket

        ws = websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels",
            header=[f"Authorization: token {self.token}"],
            timeout=timeout,
        )
        try:
            msg_id = uuid.uuid4().hex
            ws.send(
                json.dumps(
                    {
                        "header": {
                            "msg_id": msg_id,
                            "msg_type": "execute_request",
                            "username": "test",
                            "session": "t",
                            "version": "5.3",
                            "date": "",
                        },
                        "parent_header": {},
                        "metadata": {},
                        "channel": "shell",
                        "content": {
                            "code": code,
                            "silent": False,
                            "store_history": False,
                            "user_expressions": {},
                            "allow_stdin": False,
                            "stop_on_error": True,
                        },
                    }
                )
            )
            out, shown = "", ""
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                msg = json.loads(ws.recv())
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    out += content["text"]
                elif kind in ("display_data", "update_display_data"):
                    shown += content["data"].get("text/plain", "") + "\n"
                elif kind == "error":
                    raise AssertionError("\n".join(content["traceback"]) + "\n" + out)
                elif kind == "status" and content["execution_state"] == "idle":
                    return out + shown
            raise TimeoutError(out)
        finally:
            ws.close()

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited; see {self.root / 'jupyterlab.log'}")
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"JupyterLab did not answer in {timeout} s; see {self.root / 'jupyterlab.log'}")

    def kernel_pids(self) -> list[int]:
        """Process ids of the kernels this server started."""
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        return [p.pid for p in kids if any("ipykernel" in part for part in p.cmdline())]

    def close(self) -> None:
        """Shut the server and its kernels down, waiting for every process it started."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        try:
            self.api("shutdown", method="POST")
        except OSError:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _, alive = psutil.wait_procs(kids, timeout=20)
        for p in alive:
            p.kill()
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """One JupyterLab server for the tests of a module (the panel display, MLflow's default store in its root)."""
    server = Lab(tmp_path_factory.mktemp("lab"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def notebooks(lab: Lab, request: pytest.FixtureRequest) -> Lab:
    """The module's JupyterLab server with the notebooks of the module's `NOTEBOOKS` ({file name: cells}) in its
    root."""
    for name, cells in request.module.NOTEBOOKS.items():
        write_notebook(lab.root / name, cells)
    return lab


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


class KernelWatch:
    """What the Jupyter server says of one kernel through a call: its IOPub status messages and its REST state.

    A thread reads the kernel's IOPub over the server's websocket, as a second frontend would, and keeps every status
    message as (time, state, parent msg_type, parent msg_id, the parent's subshell id or ""). Another reads
    `GET /api/kernels/<id>` every `every` s and keeps (time asked, time answered, execution_state).
    `idle_mid_call` judges the readings taken while a given request ran.
    """

    def __init__(self, lab: Lab, kernel_id: str, every: float = 0.25) -> None:
        import threading

        import websocket

        self.lab, self.kernel_id, self.every = lab, kernel_id, every
        self.statuses: list[tuple[float, str, str, str, str]] = []
        self.inputs: list[tuple[str, str]] = []  # (parent msg_id, code) of every execute_input
        self.samples: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._ws = websocket.create_connection(
            f"ws://127.0.0.1:{lab.port}/api/kernels/{kernel_id}/channels?session_id=watch-{secrets.token_hex(4)}",
            header=[f"Authorization: token {lab.token}"],
            timeout=1,
        )
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._read, self._sample)]
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        import websocket

        while not self._stop.is_set():
            try:
                msg = json.loads(self._ws.recv())
            except websocket.WebSocketTimeoutException:
                continue
            except (OSError, websocket.WebSocketException):
                return
            parent = msg.get("parent_header") or {}
            if msg.get("msg_type") == "status":
                where = parent.get("subshell_id") or ""
                self.statuses.append(
                    (
                        time.monotonic(),
                        msg["content"]["execution_state"],
                        parent.get("msg_type", ""),
                        parent.get("msg_id", ""),
                        where,
                    )
                )
            elif msg.get("msg_type") == "execute_input":
                self.inputs.append((parent.get("msg_id", ""), msg["content"]["code"]))

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            asked = time.monotonic()
            try:
                state = self.lab.api(f"kernels/{self.kernel_id}")["execution_state"]
            except OSError:
                continue
            self.samples.append((asked, time.monotonic(), state))

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)
        self._ws.close()

    def request_of(self, code_part: str) -> str:
        """The msg_id of the execute_request whose code contains `code_part`."""
        (msg_id,) = [m for m, code in self.inputs if code_part in code][-1:]
        return msg_id

    def during(self, msg_id: str) -> list[tuple[float, float, str]]:
        """The REST readings taken wholly between the request's own busy and its own idle, as this watch received
        them (a reading asked within `every` s of either end is left out: the server may have seen that status a
        moment before or after this watch)."""
        mine = [s for s in self.statuses if s[3] == msg_id]
        start = next(t for t, state, *_ in mine if state == "busy")
        end = next(t for t, state, *_ in reversed(mine) if state == "idle")
        return [s for s in self.samples if s[0] > start + self.every and s[1] < end - self.every]

    def others_ended_during(self, msg_id: str) -> list[tuple[float, str, str, str, str]]:
        """The `idle` status messages of other requests published while the request ran (e.g. JupyterLab's
        create_subshell_request on a kernel's first widget)."""
        mine = [s[0] for s in self.statuses if s[3] == msg_id]
        return [s for s in self.statuses if mine[0] < s[0] < mine[-1] and s[3] != msg_id and s[1] == "idle"]

    def idle_mid_call(self, msg_id: str) -> str:
        """'' when every reading during the request read busy; else the readings and the status messages around."""
        readings = self.during(msg_id)
        bad = [s for s in readings if s[2] != "busy"]
        if not bad:
            return ""
        lines = [f"{len(bad)} of {len(readings)} readings not busy: {bad}"]
        for asked, answered, state in bad:
            near = [s for s in self.statuses if asked - 2 < s[0] < answered + 1]
            lines.append(f"around {asked:.2f}-{answered:.2f} ({state}): {near}")
        return "\n".join(lines)
