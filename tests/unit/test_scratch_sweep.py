"""A Ray rank's scratch directory (launch/files/scratch.py) is held by its process: the sweep an actor makes at its
first call removes the ones no process holds any more (a rank killed with its node), and keeps those in use."""

from __future__ import annotations

import tempfile

from air_magic.launch.files import scratch
from air_magic.launch.files.rundir import RunDir


def test_the_sweep_removes_what_a_killed_rank_left_and_keeps_what_a_live_one_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = RunDir.scratch("killed-rank1")
    (gone.path / "rank-1.log").write_text("killed\n")
    scratch.release(gone.path)  # what the kernel does when its process is killed: the lock is let go, files stay
    mine = RunDir.scratch("live-rank0")
    (mine.path / "rank-0.log").write_text("running\n")
    other = tmp_path / "air_magic-not-a-scratch"
    other.mkdir()  # no `.held`: not a rank's scratch, left alone
    assert scratch.sweep() == [gone.path]
    assert not gone.path.exists() and (mine.path / "rank-0.log").exists() and other.exists()
    mine.remove()
    assert not mine.path.exists()
    assert scratch.sweep() == []
