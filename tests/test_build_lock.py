"""A torch extension build killed midway leaves its lock: the next call's rank removes it and says so, instead of
waiting for it forever in its own build."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from faults_common import Recorder, run_here

pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]


def _waits_for_the_build_lock(lock: str) -> str:
    from torch.utils.file_baton import FileBaton

    FileBaton(lock).wait()  # what torch.utils.cpp_extension.load does while another process builds
    return "built"


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_call(tmp_path: Path, monkeypatch):
    """The stale lock is removed before the rank's code runs; the rank's build goes on; its log says why."""
    build = tmp_path / "deepspeed_shm_comm"
    build.mkdir()
    lock = build / "lock"
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # what a build killed after FileBaton.try_acquire leaves
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    heard = Recorder()
    result = run_here(
        _waits_for_the_build_lock, str(lock), listener=heard, num_accelerators=1, accelerator_type="CPU", timeout=120
    )
    assert result.values == ["built"] and not lock.exists()
    assert f"air_magic: removed {lock}" in heard.output(0)
