"""A command run's rank files (cli/command_rank.py): the time index `logs --minutes` reads, and the names."""

from __future__ import annotations

from air_magic.cli import command_rank
from air_magic.cli.command_rank import TimeIndex, lines_since, rank_file, times_of


def _write(log, index, text: str) -> None:
    data = text.encode()
    index.note(len(data))
    with open(log, "ab") as f:
        f.write(data)


def test_minutes_are_read_from_the_time_index(tmp_path, monkeypatch):
    """Lines are shown from the first index entry of the last minutes, each line whole (an entry that begins
    mid-line takes the line's start); a log without an index has no times; nothing new is no lines."""
    log = tmp_path / "rank_0.log"
    clock = [1000.0]
    monkeypatch.setattr(command_rank.time, "time", lambda: clock[0])
    index = TimeIndex(log, 0)
    _write(log, index, "old one\nold two\n")
    clock[0] = 1000.5  # within INDEX_EVERY: no new entry
    _write(log, index, "old three\npartial ")
    clock[0] = 1300.0
    _write(log, index, "end of it\nnew one\n")
    clock[0] = 1400.0
    _write(log, index, "newest\n")
    index.close()
    assert times_of(log).read_text().splitlines() == ["1000.000 0", "1300.000 34", "1400.000 52"]
    assert lines_since(log, 1200.0) == ["partial end of it", "new one", "newest"]
    assert lines_since(log, 1350.0) == ["newest"]
    assert lines_since(log, 0.0) == ["old one", "old two", "old three", "partial end of it", "new one", "newest"]
    assert lines_since(log, 2000.0) == []
    assert lines_since(tmp_path / "rank_1.log", 0.0) is None


def test_a_ranks_files_are_named_by_its_global_rank(tmp_path):
    assert rank_file(tmp_path, 3, "log") == tmp_path / "rank_3.log"
    assert times_of(tmp_path / "node_0.log") == tmp_path / "node_0.log.times"


def test_the_commands_environment_has_the_rank_hook_first_on_its_pythonpath(tmp_path):
    """With a rank directory, the hook's directory (only a sitecustomize.py) is first on PYTHONPATH, the file's own
    PYTHONPATH after it, and the directory named; `AIR_MAGIC_RANK_HOOK=0` in the file turns it off."""
    from air_magic import envvars
    from air_magic.cli.files import WorkloadDir
    from air_magic.cli.node import RANK_HOOK_DIR, node_env

    assert sorted(p.name for p in RANK_HOOK_DIR.glob("*.py")) == ["sitecustomize.py"]
    node = {"num_nodes": 1, "node_rank": 0, "local_world_size": 2, "master_addr": "127.0.0.1", "master_port": 1}
    files = WorkloadDir(tmp_path)
    env = node_env({"HOME": "/h"}, {**node, "env_variables": {"PYTHONPATH": "/mine"}}, files, tmp_path, tmp_path / "n")
    assert env["PYTHONPATH"] == f"{RANK_HOOK_DIR}:/mine" and env[envvars.RANK_DIR] == str(tmp_path / "n")
    assert node_env({}, node, files, tmp_path, tmp_path / "n")["PYTHONPATH"] == str(RANK_HOOK_DIR)
    off = node_env({}, {**node, "env_variables": {envvars.RANK_HOOK: "0"}}, files, tmp_path, tmp_path / "n")
    assert "PYTHONPATH" not in off and envvars.RANK_DIR not in off
    assert "PYTHONPATH" not in node_env({}, node, files, tmp_path)
