"""What air_magic knows about the Jupyter server that started this kernel: its base URL and its proxy routes.

A kernel started by a Jupyter server can hand out links that go through that
server (jupyter-server-proxy, enabled by `jupyter-config/`), so a browser that
reaches Jupyter (through an SSH tunnel, say) reaches the local MLflow UI and
the Ray dashboard too, with Jupyter's authentication. Used by the MLflow link
(tracking/ui.py) and the Ray dashboard link (launch/ray/cluster.py).
Imports nothing of Jupyter unless asked for a URL.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path


def jupyter_base_url() -> str | None:
    """The base URL of the Jupyter server that started this kernel, or None outside Jupyter
    (or when jupyter-server-proxy is not installed).

    A Jupyter server writes `jpserver-<pid>.json` in the runtime directory; the
    kernel's parent process is that server.
    """
    if importlib.util.find_spec("jupyter_server_proxy") is None:
        return None  # no proxy route in that server: the direct link is the one that works
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:
        return None
    for pid in {os.getppid(), int(os.environ.get("JPY_PARENT_PID", "0") or 0)} - {0}:
        info = Path(jupyter_runtime_dir()) / f"jpserver-{pid}.json"
        try:
            data = json.loads(info.read_text())
        except (OSError, ValueError):
            continue
        base = str(data.get("base_url") or "/")
        return base if base.endswith("/") else base + "/"
    return None


def absolute_proxy_path(base_url: str, port: int) -> str:
    """The path under which the server relays `port` on this machine, keeping the full path (no trailing slash).

    For an app that is told its prefix (MLflow's `--static-prefix`), so its pages link to themselves correctly.
    """
    return f"{base_url}proxy/absolute/{port}"
