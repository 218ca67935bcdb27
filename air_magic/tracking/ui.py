"""The link to an MLflow run, and the local MLflow UI started on demand when no server is configured.

With an http(s) tracking URI the link is that server's run page. With a local
store (sqlite, files) this module starts one `mlflow server` per store and
kernel, bound to 127.0.0.1 on a free port, over the same store, and reuses it
for later calls. When the kernel was started by a Jupyter server, the link
goes through that server's `/proxy/absolute/<port>/` route (air_magic.jupyter),
with MLflow's `--static-prefix` set to match:
the browser then reaches the UI through Jupyter itself, with Jupyter's
authentication, so an SSH tunnel to Jupyter is enough.

The UI starts when it is first asked for, not with the call. The kernel binds
the link's port on 127.0.0.1 itself and hands the listening socket to a small
watchdog process (`watchdog_main`, in its own session), so the link is right
from the start and costs nothing until it is opened. At the first connection
(a click on the link, a health check) the watchdog starts `mlflow server` on a
private port (again on another, should it exit before it answered: `_Server`) and relays that connection and every
later one to it: a first
call, with ranks importing torch and mlflow, does not share the CPU with an
MLflow UI nobody has opened yet (about 7 CPU-seconds), and the first click
waits for the UI's start instead (a few seconds; the page then opens).

The watchdog reads a pipe from the kernel; when the kernel exits (or is
killed) the pipe closes and the watchdog ends the UI's whole process tree.
It runs this module by name (`_BOOT`). This module does not import mlflow.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ..jupyter import absolute_proxy_path, jupyter_base_url
from ..launch.boot import boot_command

#: What the watchdog process runs; tests and the process-tree checks find it by this module's name in its command line.
_BOOT = boot_command("air_magic.tracking.ui", "watchdog_main")
#: The query that makes MLflow 3's UI show a run in its model-training view.
TRAINING_VIEW = "workflowType=machine_learning"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalUI:
    """One local MLflow UI over one store, owned by this process."""

    store_uri: str
    port: int
    prefix: str  # MLflow's --static-prefix, "" for none
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def direct_url(self) -> str:
        """The UI's address on this machine (works without Jupyter)."""
        return f"http://127.0.0.1:{self.port}{self.prefix}/"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """Close the watchdog's pipe; it ends the UI's process group, then exits."""
        from ..launch.stopper import close_by_eof

        close_by_eof(self.proc, timeout, lambda: os.killpg(self.proc.pid, signal.SIGKILL))


_uis: dict[str, LocalUI] = {}
_lock = threading.Lock()


def local_ui(store_uri: str, jupyter_base: str | None) -> LocalUI:
    """The UI for `store_uri`: its port is listening from now on; the UI itself starts when first asked for."""
    with _lock:
        ui = _uis.get(store_uri)
        if ui is not None and ui.alive:
            return ui
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            port = int(listener.getsockname()[1])
            prefix = absolute_proxy_path(jupyter_base, port) if jupyter_base is not None else ""
            from ..launch.files.rundir import helper_log

            log_path = helper_log("mlflow-ui", os.getpid(), port)
            cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store_uri, "--workers", "1"]
            if prefix:
                cmd += ["--static-prefix", prefix]
            env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", PYTHONUNBUFFERED="1")
            env.pop("MLFLOW_RUN_ID", None)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOT, json.dumps(cmd), str(listener.fileno())],
                    stdin=subprocess.PIPE,
                    stdout=fd,
                    stderr=fd,
                    env=env,
                    start_new_session=True,
                    pass_fds=(listener.fileno(),),
                )
            finally:
                os.close(fd)
        finally:
            listener.close()  # the watchdog holds its own copy
        ui = LocalUI(store_uri, port, prefix, proc, log_path)
        _uis[store_uri] = ui
        return ui


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """A link that opens the run in an MLflow UI that is really there, or None if there is no such UI."""
    # workflowType=machine_learning: MLflow 3's UI otherwise opens runs in its GenAI view ("Evaluation runs").
    fragment = f"#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_VIEW}"
    scheme = urlparse(tracking_uri).scheme
    if scheme in ("http", "https"):
        return tracking_uri.rstrip("/") + "/" + fragment
    if scheme not in ("sqlite", "file", "postgresql", "mysql", "mssql", ""):
        return None  # databricks and other hosted stores have their own UI links
    base = jupyter_base_url()
    ui = local_ui(tracking_uri, base)
    if base is not None:
        return f"{ui.prefix}/{fragment}"  # same origin as the notebook page: goes through Jupyter
    return ui.direct_url + fragment


def call_link(record: dict[str, object]) -> str | None:
    """The link to the MLflow run of a call's record (calls/record.py) that works from this process while it lives.

    A configured server's link is the server's. A local store's link is this process's local UI over the call's
    store (started on demand, as for its own calls), not the one of the call's owner, which ends with it. A record
    that does not name its store keeps its own link."""
    uri, experiment_id, run_id = record.get("tracking_uri"), record.get("experiment_id"), record.get("run_id")
    if not (uri and experiment_id and run_id):
        link = record.get("link")
        return str(link) if link else None
    return run_url(str(uri), str(experiment_id), str(run_id))


def wait_ready(ui: LocalUI, timeout: float = 120.0) -> None:
    """Block until the UI answers its health check (for tests and scripts that open the link at once)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not ui.alive:
            raise RuntimeError(f"the local MLflow UI exited; its log: {ui.log_path}")
        try:
            with urllib.request.urlopen(f"{ui.direct_url}health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the local MLflow UI did not answer in {timeout:g} s; its log: {ui.log_path}")


def shutdown() -> None:
    """Stop every UI this process started."""
    with _lock:
        uis = list(_uis.values())
        _uis.clear()
    for ui in uis:
        ui.stop()


atexit.register(shutdown)


# -- the watchdog process ---------------------------------------------------
#: Times the watchdog starts the UI when it exits before it ever answered (its private port was taken meanwhile).
STARTS = 3


class _Server:
    """The `mlflow server` behind the watchdog and its private port. A port is picked free, but the server binds it
    seconds later (it imports mlflow first): on a busy machine an outgoing connection may take it meanwhile, and the
    server exits with "address already in use". One that exits before any connection reached it is started again
    on a new port, at most STARTS times in all; relays wait for it (`port`, `lost()`)."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.child: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0
        self.served = False
        self.lock = threading.Lock()

    def start(self) -> None:
        self.port = _free_port()
        self.child = subprocess.Popen(
            [*self.cmd, "--host", "127.0.0.1", "--port", str(self.port)], stdin=subprocess.DEVNULL
        )
        self.starts += 1

    def lost(self) -> bool:
        """Whether the server exited for good (after it served, or with no start left); one that exited before it
        served, with starts left, is started again here."""
        with self.lock:
            if self.child is None or self.child.poll() is None:
                return False
            if self.served or self.starts >= STARTS:
                return True
            self.start()
            return False


def watchdog_main() -> None:
    """Serve the port whose listening socket is fd argv[2]: at its first connection start the UI command given
    as JSON in argv[1] (on a private port), relay every connection to it; until stdin closes, the parent goes
    or the UI exits, then end it all."""
    from ..launch.stopper import become_subreaper

    server = _Server(json.loads(sys.argv[1]))
    listener = socket.socket(fileno=int(sys.argv[2]))
    parent = os.getppid()
    become_subreaper()  # orphans of the UI (uvicorn under a dead `mlflow server`) are re-parented here
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the pipe or the parent's exit ends us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while os.getppid() == parent and not server.lost():
            ready, _, _ = select.select([0, listener.fileno()], [], [], 1.0)
            if 0 in ready and not os.read(0, 4096):
                break
            if listener.fileno() not in ready:
                continue
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with server.lock:
                if server.child is None:
                    server.start()
            threading.Thread(target=_relay, args=(conn, server), daemon=True).start()
    finally:
        listener.close()
        _end_all()


def _relay(client: socket.socket, server: _Server, patience: float = 180.0) -> None:
    """Copy bytes both ways between `client` and the UI, once the UI accepts (it may still be starting)."""
    deadline = time.monotonic() + patience
    upstream = None
    while upstream is None:
        try:
            upstream = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        except OSError:
            if server.lost() or time.monotonic() > deadline:
                client.close()
                return
            time.sleep(0.1)
    server.served = True
    upstream.settimeout(None)
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy `src` to `dst` until `src` ends; then end `dst`'s sending side so the other direction can end too."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _end_all() -> None:
    """SIGTERM every descendant, SIGKILL what is left after the grace, and reap them all."""
    import psutil

    from ..launch.stopper import stop_tree

    stop_tree(lambda: psutil.Process().children(recursive=True))
