"""What the Jupyter server says of one kernel through a call, read as a second frontend would (`KernelWatch`)."""

from __future__ import annotations

import json
import secrets
import time

from lab import Lab


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
