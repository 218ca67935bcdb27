"""A frontend's view of a kernel's widgets, rebuilt from IOPub messages (no browser needed)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from helpers import CellResult, Kernel


@dataclass
class WidgetMirror:
    """Widget models by comm id, as a frontend would hold them after the messages seen so far."""

    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    update_bytes: int = 0  # size of the state updates received, as JSON text
    largest_update: int = 0

    def feed(self, msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "comm_open" and content.get("target_name") == "jupyter.widget":
            self.models[content["comm_id"]] = dict(content["data"].get("state", {}))
        elif kind == "comm_msg" and content["comm_id"] in self.models:
            data = content["data"]
            if data.get("method") in ("update", "echo_update"):
                import json

                size = len(json.dumps(data.get("state", {})))
                self.update_bytes += size
                self.largest_update = max(self.largest_update, size)
                self.models[content["comm_id"]].update(data.get("state", {}))

    def of_model(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        """(comm id, state) of every widget whose model is `name` (e.g. 'ButtonModel')."""
        return [(cid, s) for cid, s in self.models.items() if s.get("_model_name") == name]

    def panel(self) -> dict[str, Any]:
        """The last panel shown: its tab titles, each tab's log and usage HTML, its status and link text, its button
        id."""
        tabs = self.of_model("TabModel")
        assert tabs, "no panel was displayed"
        _, tab = tabs[-1]
        pages = [self.models[ref.removeprefix("IPY_MODEL_")] for ref in tab["children"]]
        # a tab holds the rank's usage line over its log (or, in a panel without usage, the log alone)
        parts = [
            [self.models[r.removeprefix("IPY_MODEL_")] for r in p["children"]] if "children" in p else [p]
            for p in pages
        ]
        # beside the log a tab may hold the rank's usage line and its step times (the watch): neither is the log
        extras = ("air-magic-usage", "air-magic-steps")
        logs = [next(m["value"] for m in part if not set(extras) & set(m.get("_dom_classes", ()))) for part in parts]
        usages = [
            next((m["value"] for m in part if "air-magic-usage" in m.get("_dom_classes", ())), "") for part in parts
        ]
        buttons = self.of_model("ButtonModel")
        htmls = [s["value"] for _, s in self.of_model("HTMLModel")]
        return {
            "titles": list(tab["titles"]),
            "logs": logs,
            "usages": usages,
            "button": buttons[-1][0] if buttons else None,
            "button_state": buttons[-1][1] if buttons else None,
            "status": next((h for h in reversed(htmls) if "rank(s)" in h), ""),
            "link": next((h for h in reversed(htmls) if "MLflow" in h and "rank(s)" not in h), ""),
        }


def run_cell(
    kernel: Kernel,
    code: str,
    mirror: WidgetMirror,
    timeout: float = 180,
    while_running: Callable[[WidgetMirror], None] | None = None,
) -> CellResult:
    """Execute `code`, feeding every IOPub message to `mirror`; `while_running` is called after each message."""
    msg_id = kernel.send(code)
    out = CellResult()
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"cell did not finish in {timeout} s; stdout so far:\n{out.stdout[-2000:]}")
        mirror.feed(msg)
        kind, content = msg["msg_type"], msg["content"]
        mine = msg["parent_header"].get("msg_id") == msg_id
        if mine and kind == "stream":
            if content["name"] == "stdout":
                out.stdout += content["text"]
            else:
                out.stderr += content["text"]
        elif mine and kind == "execute_result":
            out.result = content["data"].get("text/plain")
        elif mine and kind == "error":
            out.error = content
        elif mine and kind in ("display_data", "update_display_data"):
            out.displays.append(content)
        elif mine and kind == "status" and content["execution_state"] == "idle":
            return out
        if while_running is not None:
            while_running(mirror)


def click(kernel: Kernel, comm_id: str) -> None:
    """Send the comm message a browser sends when a Button is clicked."""
    msg = kernel.kc.session.msg(
        "comm_msg", {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}}
    )
    kernel.kc.shell_channel.send(msg)
