"""Stop after this step (air_magic/stopping.py) and the native frames a rank's stacks carry (launch/stacks.py)."""

from __future__ import annotations

import pytest

from air_magic import envvars, stopping
from air_magic.launch import native_frames
from air_magic.launch.files.stack_dumps import parse


@pytest.fixture
def rank_of(monkeypatch):
    """Make this process look like a rank of the call whose run directory is given (no process group)."""

    def become(path):
        monkeypatch.setenv(envvars.INTERNAL_RUN_DIR, str(path))

    monkeypatch.setattr(stopping, "CHECK_EVERY", 0.0)
    return become


def test_should_stop_turns_true_once_a_stop_is_asked_and_only_for_that_call(tmp_path, rank_of):
    """A rank's should_stop() is False until the Stop's flag is left in its run directory, then stays True; the next
    call of the same process (a hot rank, a session cell) starts False again."""
    first, second = tmp_path / "call-1", tmp_path / "call-2"
    first.mkdir()
    second.mkdir()
    rank_of(first)
    assert stopping.should_stop() is False
    assert stopping.request_stop(first) is True
    assert stopping.request_stop(first) is False  # asked already
    assert stopping.stop_requested(first)
    assert stopping.should_stop() is True
    (first / "stop").unlink()
    assert stopping.should_stop() is True  # decided: the same answer for the rest of the call
    rank_of(second)
    assert stopping.should_stop() is False


def test_between_two_looks_a_rank_answers_from_memory(tmp_path, monkeypatch):
    """The flag's file is looked at no more often than CHECK_EVERY: a loop pays for a stat at most that often."""
    monkeypatch.setenv(envvars.INTERNAL_RUN_DIR, str(tmp_path))
    monkeypatch.setattr(stopping, "CHECK_EVERY", 3600.0)
    assert stopping.should_stop() is False
    stopping.request_stop(tmp_path)
    assert stopping.should_stop() is False  # not looked at again yet
    monkeypatch.setattr(stopping, "CHECK_EVERY", 0.0)
    assert stopping.should_stop() is True


def test_outside_a_rank_should_stop_is_false(monkeypatch):
    """In the notebook (no run directory of a call) it never says stop."""
    monkeypatch.delenv(envvars.INTERNAL_RUN_DIR, raising=False)
    assert stopping.should_stop() is False


_DUMP = """training
air_magic: stacks of pid 41 (the rank), on request at 12:00:01, most recent call first:
Current thread 0x00007f (most recent call first):
  File "/tmp/ipykernel_1/9.py", line 5 in waiting_for_the_slow_rank
air_magic: native stacks of pid 41 (py-spy dump --native):
  | Thread 41 (idle): "MainThread"
  |     c10d::Work::wait (libtorch_cpu.so)
  |     all_reduce (torch/distributed/distributed_c10d.py:2501)
air_magic: end of the stacks of pid 41
air_magic: stacks of pid 42 (the rank), on request at 12:00:02, most recent call first:
Current thread 0x00008f (most recent call first):
  File "/tmp/ipykernel_1/9.py", line 3 in stuck
air_magic: no native stacks of pid 42: the platform does not let py-spy attach (ptrace not permitted)
air_magic: end of the stacks of pid 42
"""


def test_a_dump_carries_the_native_frames_or_why_there_are_none():
    """py-spy's lines written into a dump are read back with it and shown after the Python frames; where py-spy could
    not attach, the dump says why."""
    with_native, without = parse(_DUMP)
    assert with_native.native[1].strip() == "c10d::Work::wait (libtorch_cpu.so)"
    assert "Native frames too (py-spy dump --native)" in with_native.text()
    assert "c10d::Work::wait (libtorch_cpu.so)" in with_native.text()
    assert with_native.user_frame() is not None
    assert without.native == [] and without.native_note is not None
    assert "No native frames: the platform does not let py-spy attach" in without.text()


def test_without_py_spy_each_rank_says_so(monkeypatch):
    """No py-spy program: each process's dump says it is not installed, and nothing is started."""
    monkeypatch.setattr(native_frames, "py_spy", lambda: None)
    said = native_frames.native_stacks([41, 42])
    assert said[41] == "air_magic: no native stacks of pid 41: py-spy is not installed (pip install py-spy)\n"
    assert native_frames.native_stacks([]) == {}
    assert "ptrace not permitted" in native_frames._why_not("Error: Permission Denied (os error 13)")
