"""Awkward output (odd bytes, progress bars, a 200 MB flood) and a full disk: kept, shown, and clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest
from faults_common import (
    Recorder,
    assert_nothing_left,
    assert_nothing_lost,
    procs,
    run_dirs,
    run_here,
)
from helpers import leftover_processes, reported

from air_magic.errors import (
    RunDirectoryFullError,
)
from air_magic.job import JobStatus
from air_magic.launch.files.rundir import RunDir

pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]


# -- 12. awkward output ----------------------------------------------------------------------------


def test_odd_bytes_unfinished_lines_and_progress_bars_are_kept_and_shown(fault_kernel):
    """Invalid UTF-8, a last line with no newline, carriage-return progress bars and C-level writes crash nothing and
    are all in the logs."""
    before = procs()
    out = fault_kernel.execute(
        """
@distributed(2, timeout=120)
def awkward():
    import os, sys
    rank = int(os.environ["RANK"])
    os.write(1, b"raw \\xff\\xfe bytes from rank %d\\n" % rank)
    for pct in range(0, 101, 25):
        sys.stdout.write(f"\\rprogress {pct}%")
        sys.stdout.flush()
    sys.stdout.write("\\n")
    print(f"to stderr from rank {rank}", file=sys.stderr)
    os.write(2, b"C-level write from rank %d\\n" % rank)
    sys.stdout.write(f"no newline at the end from rank {rank}")
    return rank
value, error, ended = timed(awkward)
print("REPORT " + json.dumps({"value": value, "error": type(error).__name__}))
"""
    ).check()
    assert reported(out.stdout) == {"value": [0, 1], "error": "NoneType"}
    (run_dir,) = run_dirs(out.stdout)
    for rank in (0, 1):
        log = RunDir(run_dir).log(rank).read_bytes()
        assert b"raw \xff\xfe bytes from rank %d\n" % rank in log
        assert b"\rprogress 0%\rprogress 25%\rprogress 50%\rprogress 75%\rprogress 100%\n" in log
        assert f"[rank {rank}] raw \ufffd\ufffd bytes from rank {rank}" in out.stdout
        assert "progress 100%" in out.stdout
    printed = {
        r: [f"to stderr from rank {r}", f"C-level write from rank {r}", f"no newline at the end from rank {r}"]
        for r in (0, 1)
    }
    assert_nothing_left(before)
    assert_nothing_lost(run_dir, printed, out.stdout)


def _floods(megabytes: int) -> str:
    import hashlib
    import sys

    digest = hashlib.sha256()
    if os.environ["RANK"] == "0":
        block = "".join(f"line {i:07d} " + "y" * 86 + "\n" for i in range(10_000)).encode()  # 1 MB
        for _ in range(megabytes):
            sys.stdout.buffer.write(block)
            digest.update(block)
        sys.stdout.flush()
    return digest.hexdigest()


def test_a_200_mb_flood_from_one_rank_reaches_the_log_and_the_listeners_in_full():
    """200 MB printed by one rank is in its log byte for byte and every character reaches the listeners."""
    before = procs()
    rec = Recorder()
    result = run_here(_floods, 200, listener=rec)
    import hashlib

    log = RunDir(result.run_dir).log(0)
    digest = hashlib.sha256()
    with open(log, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    assert digest.hexdigest() == result.values[0]
    assert log.stat().st_size == rec.chars[0] == 200 * 1_000_000
    assert_nothing_left(before)
    assert_nothing_lost(result.run_dir, {0: ["line 0000000 ", "line 0009999 "]})
    shutil.rmtree(result.run_dir)  # 200 MB: do not keep it in pytest's temporary directories


# -- 13. disk full ---------------------------------------------------------------------------------


#: The small disk's size. Room for two calls' payloads: a call carries the code of every module its process imported
#: from outside installed packages (payload.py), which in a pytest worker of the whole suite is about 1 MiB.
TINY_MIB = 16


@pytest.fixture
def tiny_disk(tmp_path):
    """A TINY_MIB tmpfs to hold the run directories (skipped where mounting is not allowed)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TINY_MIB}m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}); run as root to test a full disk")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fills_the_disk() -> None:

    rank = int(os.environ["RANK"])
    print(f"rank {rank} before the disk fills", flush=True)
    if rank == 0:
        # the disk fills once rank 1's line is in its log (a line printed after it is full has nowhere to go)
        log = os.path.join(os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"], "rank-1.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(log):
                with open(log, "rb") as f:
                    if b"before the disk fills" in f.read():
                        break
            time.sleep(0.05)
        for i in range(TINY_MIB * 12_000):  # 98 bytes a line: more than the disk holds
            print(f"{i:06d} " + "z" * 90)
    time.sleep(300)


def _returns_too_much() -> bytes:

    return b"r" * ((TINY_MIB + 1) << 20) if os.environ["RANK"] == "1" else b""


def _fills_the_disk_then_raises(where: str) -> None:

    fd = os.open(os.path.join(where, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"f" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)
    raise ValueError("the real error, raised with the disk full")


def test_a_rank_that_fails_on_a_full_disk_still_reports_its_own_exception(tiny_disk, monkeypatch):
    """Room for the error record is set aside when the run starts, so a full disk cannot swallow the exception."""
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tiny_disk))
    with pytest.raises(RunDirectoryFullError, match="is full") as info:
        run_here(_fills_the_disk_then_raises, str(tiny_disk), num_accelerators=1, timeout=120)
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "the real error, raised with the disk full"
    assert "raised on rank 0" in "\n".join(cause.__notes__)
    (run_dir,) = [p for p in tiny_disk.iterdir() if p.is_dir()]
    assert json.loads(RunDir(run_dir).error(0).read_text())["type"] == "builtins.ValueError"


def test_an_error_record_too_long_for_its_reserve_keeps_the_end_of_its_traceback(tmp_path):
    """A huge message and traceback still fit the space set aside: the record stays readable and keeps where it
    failed."""
    from air_magic.launch.files.errorfile import read_error_file, write_error_file

    run = RunDir(tmp_path)
    run.reserve_error_record(0)
    size = run.error_reserve(0).stat().st_size

    def deep(n: int) -> None:
        if n == 0:
            raise RuntimeError("\u00e9" * 20_000 + " the end of the message")
        deep(n - 1)

    try:
        deep(600)
    except RuntimeError as exc:
        write_error_file(run.error(0), run.error_pickle(0), exc, reserve=run.error_reserve(0))
    assert not run.error_reserve(0).exists() and run.error(0).stat().st_size <= size
    record = json.loads(run.error(0).read_text())
    text = record["traceback"]
    assert text.startswith("Traceback (most recent call last):") and "characters cut to fit the error record" in text
    assert text.rstrip().endswith("the end of the message") and record["type"] == "builtins.RuntimeError"
    assert len(record["message"]) == 4096
    rebuilt = read_error_file(run.error(0), run.error_pickle(0), 0)
    assert isinstance(rebuilt, RuntimeError)


def test_a_run_that_succeeds_gives_back_the_room_set_aside_for_errors(here_runs):
    """The space reserved for error records is released when ranks return: a finished run holds no reservation."""
    result = run_here(_returns_too_much)  # a small result on every rank but 1; enough room here for rank 1's
    assert [len(r.value) for r in result.ranks] == [0, (TINY_MIB + 1) << 20]
    assert sorted(p.name for p in result.run_dir.glob("*.reserved")) == []


def test_a_full_disk_under_the_run_directory_is_a_clear_error_and_stops_every_worker(tiny_disk, monkeypatch):
    """When the run directory's disk fills up, the call stops every rank and names the disk, the free space and the
    fix."""
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tiny_disk))
    before = procs()
    # a result larger than the disk: a clear error, and the half-written result does not keep the disk full
    with pytest.raises(OSError, match="could not be written") as big:
        run_here(_returns_too_much, timeout=120)
    (run_dir,) = [p for p in tiny_disk.iterdir() if p.is_dir()]
    # rank 0's tiny result may meet the full disk too: rank 1 is then named among the ranks that failed
    told = str(big.value) + "\n".join(getattr(big.value, "__notes__", []))
    assert list(run_dir.glob("*.tmp")) == [] and "rank 1" in told
    rec = Recorder()
    with pytest.raises(RunDirectoryFullError, match="is full") as info:
        run_here(_fills_the_disk, listener=rec, timeout=120)
    assert "AIR_MAGIC_RUNS_DIR" in str(info.value) and str(tiny_disk) in str(info.value)
    assert rec.result is not None and rec.result.status is JobStatus.FAILED
    assert_nothing_left(before)
    assert_nothing_lost(rec.result.run_dir, {r: [f"rank {r} before the disk fills"] for r in (0, 1)})
    assert list(rec.result.run_dir.glob("*.reserved")) == [], "stopped ranks' reserves are given back"
    # with the disk still full, the next call fails before starting anything, and says why
    with pytest.raises(Exception, match="No space left|is full"):
        run_here(_fills_the_disk, timeout=120)
    assert leftover_processes(before, wait=0, kind="job") == []
