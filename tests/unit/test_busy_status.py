"""display/busy.py on a stand-in kernel: while a call holds it, a side thread's `idle` goes out with a parent type the
Jupyter server does not count (its msg_id kept) and a `busy` for the cell follows; without a hold, nothing changes."""

from __future__ import annotations

import threading
from typing import Any

from air_magic.display import busy

CELL = {"header": {"msg_id": "cell", "msg_type": "execute_request"}}
SUBSHELL = {"header": {"msg_id": "sub", "msg_type": "create_subshell_request"}}


class FakeKernel:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []  # (status, parent msg_type, parent msg_id)

    def _publish_status(self, status: str, channel: str, parent: Any = None) -> None:
        header = (parent or SUBSHELL)["header"]
        self.sent.append((status, header["msg_type"], header["msg_id"]))

    def get_parent(self, channel: str) -> dict[str, Any]:
        return SUBSHELL


def _from_side_thread(kernel: FakeKernel, *statuses: str) -> None:
    def side() -> None:
        for status in statuses:
            kernel._publish_status(status, "control")

    thread = threading.Thread(target=side)
    thread.start()
    thread.join()


def test_a_side_threads_idle_mid_call_is_not_counted_and_busy_for_the_cell_follows(monkeypatch):
    kernel = FakeKernel()
    assert busy._install(kernel)
    monkeypatch.setattr(busy, "_parent", CELL)
    _from_side_thread(kernel, "busy", "idle")
    assert kernel.sent == [
        ("busy", "create_subshell_request", "sub"),
        ("idle", busy.UNCOUNTED, "sub"),
        ("busy", "execute_request", "cell"),
    ]
    assert busy.UNCOUNTED in ("kernel_info_request", "comm_info_request", "debug_request")


def test_without_a_hold_every_status_goes_out_as_it_is(monkeypatch):
    kernel = FakeKernel()
    assert busy._install(kernel)
    monkeypatch.setattr(busy, "_parent", None)
    _from_side_thread(kernel, "busy", "idle")
    kernel._publish_status("idle", "shell", CELL)
    assert kernel.sent == [
        ("busy", "create_subshell_request", "sub"),
        ("idle", "create_subshell_request", "sub"),
        ("idle", "execute_request", "cell"),
    ]


def test_the_main_threads_own_idle_is_never_rewritten(monkeypatch):
    kernel = FakeKernel()
    assert busy._install(kernel)
    monkeypatch.setattr(busy, "_parent", CELL)
    kernel._publish_status("idle", "shell", CELL)
    assert kernel.sent == [("idle", "execute_request", "cell")]
