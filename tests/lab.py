"""A JupyterLab server for tests and benchmarks that need a real frontend.

`Lab` starts one JupyterLab server on 127.0.0.1 with a random token in a
private root directory (its own settings, so no news or update pop-ups), with
the project's jupyter-config/ on its config path (the MLflow proxy route) and
air_magic importable by its kernels; its environment comes from
helpers.process_env. The `lab` fixture starts one per test module (tests/conftest.py registers
this module's fixtures). `Lab.execute` runs code in a kernel over the server's websocket, as a frontend does.
The browser that drives it is browser.py; what the server says of one kernel, kernel_watch.py.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import ROOT, process_env


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
        # A file that vanishes while the server lists its directory (sqlite's journal beside a test kernel's MLflow
        # store, written and removed in a moment) makes the whole listing a 404 (jupyter_server's _dir_model), and
        # the page then shows a "Directory not found" dialog over the notebook: such files are not listed.
        hidden = ["__pycache__", "*.pyc", "*.pyo", ".DS_Store", "*~", "*.so", "*.dylib", "*-journal", "*-wal", "*-shm"]
        (root / ".lab-server.json").write_text(json.dumps({"ContentsManager": {"hide_globs": hidden}}))
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
                f"--config={root / '.lab-server.json'}",
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
