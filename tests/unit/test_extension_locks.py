"""A torch extension's build lock that a killed build left is removed (and said); one a live build holds is kept."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from air_magic.launch.rank import extension_locks


@pytest.fixture
def build_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(extension_locks.EXTENSIONS_DIR, str(tmp_path))
    monkeypatch.setattr(extension_locks, "RECHECK", 0.0)
    (tmp_path / "deepspeed_shm_comm").mkdir()
    return tmp_path


def test_a_lock_no_process_holds_is_removed_and_torchs_wait_for_it_returns(build_root):
    """The lock a killed build left (created, never held again): removed, said once; FileBaton.wait then returns."""
    from torch.utils.file_baton import FileBaton

    lock = build_root / "deepspeed_shm_comm" / "lock"
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # what FileBaton.try_acquire leaves when its process dies
    (said,) = extension_locks.clear_stale()
    assert said.startswith(f"air_magic: removed {lock}") and "'deepspeed_shm_comm'" in said and "killed" in said
    assert not lock.exists()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (FileBaton(str(lock)).wait(), done.set()), daemon=True)
    waiter.start()
    assert done.wait(30)
    assert extension_locks.clear_stale() == []


def test_a_lock_a_running_build_holds_open_is_kept(build_root):
    """A build in progress holds its lock open (FileBaton keeps the descriptor): the lock stays, nothing is said."""
    from torch.utils.file_baton import FileBaton

    baton = FileBaton(str(build_root / "deepspeed_shm_comm" / "lock"))
    assert baton.try_acquire()
    try:
        assert extension_locks.holders(Path(baton.lock_file_path)) == {os.getpid()}
        assert extension_locks.clear_stale() == []
        assert Path(baton.lock_file_path).exists()
    finally:
        baton.release()


def test_where_holders_cannot_be_seen_the_lock_is_named_not_removed(build_root, monkeypatch):
    """No /proc: the lock is left and the sentence names the file to remove if no build runs."""
    lock = build_root / "deepspeed_shm_comm" / "lock"
    lock.touch()
    monkeypatch.setattr(extension_locks, "holders", lambda path: None)
    (said,) = extension_locks.clear_stale()
    assert f"{lock} exists" in said and "remove it" in said and lock.exists()


def test_without_torch_extensions_dir_the_user_cache_is_looked_at(tmp_path, monkeypatch):
    """$XDG_CACHE_HOME/torch_extensions/<python_accelerator>/<name>: torch's default build directories."""
    monkeypatch.delenv(extension_locks.EXTENSIONS_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build = tmp_path / "torch_extensions" / "py311_cpu" / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    assert extension_locks.build_directories() == [build]
