"""The largest live allocation sites of a CUDA memory snapshot (launch/files/memory_snapshot.py), read from a
hand-built dictionary of torch's snapshot format, and the peak file's round trip; no GPU needed."""

from __future__ import annotations

import pickle
from pathlib import Path

from air_magic.launch.files import memory_snapshot as m

TORCH = {"filename": "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}


def _block(size: int, state: str, *frames: dict) -> dict:
    return {"size": size + 512, "requested_size": size, "address": 0, "state": state, "frames": list(frames)}


def _frame(line: int, name: str, filename: str = "/home/me/train.py") -> dict:
    return {"filename": filename, "line": line, "name": name}


SNAPSHOT = {
    "segments": [
        {
            "device": 0,
            "total_size": 3 << 30,
            "blocks": [
                _block(1 << 30, "active_allocated", TORCH, _frame(12, "make_big"), _frame(40, "train")),
                _block(1 << 30, "active_allocated", _frame(12, "make_big"), _frame(40, "train")),
                _block(5 << 20, "active_allocated", TORCH, _frame(20, "forward_pass")),
                _block(900 << 20, "inactive"),  # cached, held by no tensor
                _block(64 << 20, "active_awaiting_free", _frame(30, "freed_soon")),
            ],
        },
        {  # another device's memory is not this rank's
            "device": 1,
            "blocks": [_block(3 << 30, "active_allocated", _frame(99, "other_gpu"))],
        },
        {  # an older snapshot keeps the frames in `history`
            "device": 0,
            "blocks": [{"size": 3 << 20, "state": "active_allocated", "history": [{"frames": [_frame(7, "old")]}]}],
        },
    ]
}


def test_the_largest_live_sites_come_first_named_by_the_users_line():
    """Live blocks ("active_allocated") of the rank's device are summed per site, the innermost frame outside torch
    naming it; cached and freed blocks and other devices' memory are left out."""
    sites = m.top_sites(SNAPSHOT, device=0)
    assert [(s.function, s.line, s.size, s.blocks) for s in sites] == [
        ("make_big", 12, 2 << 30, 2),
        ("forward_pass", 20, 5 << 20, 1),
        ("old", 7, 3 << 20, 1),
    ]
    assert sites[0].filename == "/home/me/train.py"
    assert sites[0].text() == "2.0 GiB in 2 block(s) at make_big (/home/me/train.py, line 12)"
    assert [s.function for s in m.top_sites(SNAPSHOT, limit=1)] == ["other_gpu"]  # every device, largest first


def test_a_snapshot_without_stacks_names_no_line():
    """Blocks recorded without stacks (history off, or only torch's frames) still count, under what is known."""
    snapshot = {"segments": [{"blocks": [_block(100, "active_allocated"), _block(50, "active_allocated", TORCH)]}]}
    sites = m.top_sites(snapshot)
    assert [(s.function, s.size) for s in sites] == [("?", 100), ("forward", 50)]
    assert sites[0].filename == "<no stack recorded>"


def test_a_pickled_snapshot_reads_the_same(tmp_path: Path):
    """The file torch writes is the pickled dictionary: read back, it gives the same sites."""
    path = tmp_path / "rank-0.memory.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    assert m.top_sites(pickle.loads(path.read_bytes()), device=0) == m.top_sites(SNAPSHOT, device=0)


def test_the_peak_file_round_trips(tmp_path: Path):
    """A rank's peak CUDA memory is read back as written; a missing or torn file reads None."""
    path = tmp_path / "rank-0.memory.json"
    assert m.read_peak(path) is None
    m.write_peak(path, 1, 5 << 30, 6 << 30)
    assert m.read_peak(path) == {"device": 1, "peak_allocated": 5 << 30, "peak_reserved": 6 << 30}
    path.write_text("{")
    assert m.read_peak(path) is None
    assert m.human_bytes(1536) == "1.5 KiB" and m.human_bytes(3 << 30) == "3.0 GiB" and m.human_bytes(12) == "12 B"
