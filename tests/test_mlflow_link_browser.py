"""The MLflow link of a call made under a real Jupyter server opens the run in headless Chromium, through Jupyter."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from helpers import ROOT

pytestmark = [
    pytest.mark.browser,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:websocket"),
]
websocket = pytest.importorskip("websocket")
sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterServer:
    """`jupyter server` on 127.0.0.1 with a token and the project's jupyter-config/ on its config path."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.update(
            JUPYTER_CONFIG_PATH=os.pathsep.join([str(ROOT / "jupyter-config"), env.get("JUPYTER_CONFIG_PATH", "")]),
            JUPYTER_RUNTIME_DIR=str(root / "runtime"),
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            AIR_MAGIC_RUNS_DIR=str(root / "runs"),
            AIR_MAGIC_DISPLAY="text",  # the link is read from the cell's text output
            MLFLOW_TRACKING_URI="",
        )
        (root / "runs").mkdir()
        self.log = open(root / "jupyter.log", "wb")  # noqa: SIM115 - open as long as the server runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "server", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={self.port}",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}"],
            cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                self.api("GET", "/api/status")
                return
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError("jupyter server did not start:\n" + (root / "jupyter.log").read_text())
                time.sleep(0.5)

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(
            self.url + path, method=method, data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
        return json.loads(raw) if raw else {}

    def execute(self, kernel_id: str, code: str, timeout: float = 300) -> str:
        """Run `code` in the kernel over the server's websocket; return its stdout, raise on an error."""
        ws = websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels",
            header=[f"Authorization: token {self.token}"], timeout=timeout,
        )
        try:
            msg_id = uuid.uuid4().hex
            ws.send(json.dumps({
                "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test", "session": "t",
                           "version": "5.3", "date": ""},
                "parent_header": {}, "metadata": {}, "channel": "shell",
                "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": True},
            }))
            out = ""
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                msg = json.loads(ws.recv())
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    out += content["text"]
                elif kind == "error":
                    raise AssertionError("\n".join(content["traceback"]) + "\n" + out)
                elif kind == "status" and content["execution_state"] == "idle":
                    return out
            raise TimeoutError(out)
        finally:
            ws.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def jupyter(tmp_path):
    server = JupyterServer(tmp_path)
    yield server
    server.stop()


def ui_processes() -> set[int]:
    found = set()
    for p in psutil.process_iter():
        try:
            if re.search(r"-m mlflow server\b", " ".join(p.cmdline())) and p.status() != psutil.STATUS_ZOMBIE:
                found.add(p.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (make browser)")
def test_link_opens_the_run_with_its_metric_through_jupyter(jupyter):
    """Under Jupyter the link goes through Jupyter's authenticated proxy and shows the run and its metric."""
    ui_before = ui_processes()
    kernel = jupyter.api("POST", "/api/kernels", {"name": "python3"})["id"]
    try:
        out = jupyter.execute(
            kernel,
            """
from air_magic import distributed, mlflow_ui
@distributed(num_accelerators=2)
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
        run_id = link.rsplit("/", 1)[-1]

        # Without Jupyter's credentials the proxy refuses, or sends the browser to Jupyter's login page.
        try:
            with urllib.request.urlopen(jupyter.url + link.split("#")[0], timeout=30) as anonymous:
                assert "/login" in anonymous.geturl(), f"the proxy served {anonymous.geturl()} without a login"
        except urllib.error.HTTPError as refused:
            assert refused.code in (401, 403)

        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_context(extra_http_headers={"Authorization": f"token {jupyter.token}"}).new_page()
                page.goto(jupyter.url + link, timeout=120_000)
                page.get_by_text("loss", exact=True).first.wait_for(timeout=120_000)
                body = page.inner_text("body")
                assert "train" in body, "the run's name is on the page"
                assert "loss" in body
                seen = page.request.get(jupyter.url + link.split("#")[0] + f"ajax-api/2.0/mlflow/runs/get?run_id={run_id}")
                assert seen.ok and [m["key"] for m in seen.json()["run"]["data"]["metrics"]] == ["loss"]
            finally:
                browser.close()
    finally:
        jupyter.api("DELETE", f"/api/kernels/{kernel}")
    deadline = time.monotonic() + 40
    while ui_processes() - ui_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ui_processes() - ui_before, "the local MLflow UI outlived its kernel"
