"""The local MLflow UI's watchdog (tracking/ui.py) with a stand-in server: one that exits before it ever answered (its
private port was taken while it started: "address already in use") is started again on a new port, and the first
connection still gets its answer; one that never starts is given up after `STARTS` tries."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from air_magic.tracking import ui

pytestmark = pytest.mark.slow

#: A stand-in for `mlflow server --host H --port P`: exits 1 at its first start (as when its port was taken), then
#: answers each connection with one line.
SERVER = """
import pathlib, socket, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
mark = pathlib.Path(sys.argv[1])
starts = int(mark.read_text() or 0) + 1 if mark.exists() else 1
mark.write_text(str(starts))
if starts < int(sys.argv[2]):
    sys.exit("[Errno 98] error while attempting to bind: address already in use")
with socket.create_server(("127.0.0.1", port)) as s:
    while True:
        conn, _ = s.accept()
        conn.sendall(b"served on start %d\\n" % starts)
        conn.close()
"""


def _watchdog(tmp_path: Path, ok_at: int) -> tuple[subprocess.Popen[bytes], int]:
    listener = socket.create_server(("127.0.0.1", 0))
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    cmd = [sys.executable, str(script), str(tmp_path / "starts"), str(ok_at)]
    proc = subprocess.Popen(
        [sys.executable, "-c", ui._BOOT, json.dumps(cmd), str(listener.fileno())],
        stdin=subprocess.PIPE,
        pass_fds=(listener.fileno(),),
    )
    port = listener.getsockname()[1]
    listener.close()
    return proc, port


def _ask(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.settimeout(60)
        return conn.recv(100)


def test_a_server_that_exits_before_it_served_is_started_again_on_a_new_port(tmp_path):
    proc, port = _watchdog(tmp_path, ok_at=2)
    try:
        assert _ask(port) == b"served on start 2\n"
        assert _ask(port) == b"served on start 2\n"  # the same server answers later connections
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert (tmp_path / "starts").read_text() == "2"


def test_a_server_that_never_starts_is_given_up_after_its_starts(tmp_path):
    proc, port = _watchdog(tmp_path, ok_at=ui.STARTS + 1)
    try:
        assert _ask(port) == b""  # the connection is closed: no UI to relay to
        assert proc.wait(30) == 0  # the watchdog ends with its UI
    finally:
        proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "starts").read_text() == str(ui.STARTS)
