"""`%distributed_debug ID` names any call of this user on the machine by its id, as `air-magic` does: a detached
call or a command-line run that this kernel never attached; a small number stays this kernel's own."""

from __future__ import annotations

import pytest

from air_magic.calls import debugging
from air_magic.calls.table import CallTable
from air_magic.errors import ConfigurationError


def test_a_call_of_another_process_is_found_by_its_id_and_a_number_is_this_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path))
    table = CallTable()  # this process's calls: none yet
    run_dir = tmp_path / "20261205-101500-train-abc123"
    run_dir.mkdir()
    (run_dir / "call.json").write_text("{}")
    assert debugging.find_waiting(table, "20261205-1015") == run_dir
    with pytest.raises(ConfigurationError):
        debugging.find_waiting(table, "2")  # a call number of this kernel, never the start of a machine id
    with pytest.raises(ConfigurationError, match="nothing-like-it"):
        debugging.find_waiting(table, "nothing-like-it")
