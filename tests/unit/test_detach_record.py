"""A call's live record: its status is read from disk, a cancel is asked through a private file, and a call is found
by a unique start of its id. (A dead owner's call read as failed: tests/test_detach_owner.py.)"""

from __future__ import annotations

import os
import stat

import pytest

from air_magic.calls import record as call_record
from air_magic.errors import AirMagicError
from air_magic.job import JobSpec


def _spec() -> JobSpec:
    return JobSpec(target=print, args=(), kwargs={}, name="train", world_size=2, accelerator_type="CPU", timeout=None)


def test_a_live_record_names_its_owner_and_a_cancel_is_a_private_file(tmp_path):
    """CallRecord.begin writes status and owner; load() reads it as running while this process lives; request_cancel
    leaves a 0600 file once."""
    run = tmp_path / "20260101-000000-train-abcdefgh"
    run.mkdir()
    writer = call_record.CallRecord(run, "cli")
    writer.begin(_spec(), call_record.RUNNING)
    try:
        record = call_record.load(run)
        assert record is not None
        assert (record["status"], record["owner"]["pid"], record["id"]) == ("running", os.getpid(), run.name)
        assert record["owner"]["role"] == "cli"
        assert call_record.request_cancel(run) and not call_record.request_cancel(run)
        assert call_record.cancel_requested(run)
        assert stat.S_IMODE((run / "cancel").stat().st_mode) == 0o600
        assert stat.S_IMODE((run / "call.json").stat().st_mode) == 0o600
    finally:
        writer.release()


def test_a_call_is_found_by_a_unique_start_of_its_id(tmp_path):
    """A unique start finds the call; a start shared by two is an error naming both; an unknown one says so."""
    for name in ("20260101-000000-train-aaaa", "20260101-000000-train-abbb"):
        (tmp_path / name).mkdir()
        call_record._save(tmp_path / name, {"id": name, "status": "finished"})
    assert call_record.find_dir("20260101-000000-train-aa", tmp_path).name == "20260101-000000-train-aaaa"
    with pytest.raises(AirMagicError, match="names 2 calls"):
        call_record.find_dir("20260101-000000-train-a", tmp_path)
    with pytest.raises(AirMagicError, match="no call 'zzz'"):
        call_record.find_dir("zzz", tmp_path)


def test_the_final_record_is_written_once_and_lets_the_owner_lock_go(tmp_path):
    """A call's record writer writes its final line once (a second end changes nothing), and a reader then sees the
    call ended, not orphaned, though the lock is free."""
    run = tmp_path / "20260101-000000-train-abcdefgh"
    run.mkdir()
    record = call_record.CallRecord(run)
    record.begin(_spec(), call_record.WAITING, waiting_for="2 CPU slot(s)")
    record.running(_spec())
    assert call_record.read(run)["status"] == "running" and call_record.read(run)["waiting_for"] == ""  # type: ignore[index]
    record.end(None, None)
    first = call_record.read(run)
    record.end(None, RuntimeError("a second end"))
    assert call_record.read(run) == first
    loaded = call_record.load(run)
    assert loaded is not None and loaded["status"] == "failed" and not loaded.get("orphaned")


def test_a_call_rebuilt_from_its_record_has_the_alerts_its_watch_raised(tmp_path):
    """`DistributedCall.from_run_dir` (and an attached call's end) gives back the alerts the record keeps: a call of
    another process named a straggler, and `attach(ID).alerts` said nothing."""
    from air_magic.calls.handle import DistributedCall
    from air_magic.job import Alert, JobResult, JobStatus, RankResult, RankState

    run = tmp_path / "20260101-000000-train-abcdefgh"
    run.mkdir()
    record = call_record.CallRecord(run)
    record.begin(_spec(), call_record.RUNNING)
    straggler = Alert("straggler", 1, "compute", "rank 1 is a straggler: 0.15 s per step behind", 1.0e9, 0.15)
    ranks = [RankResult(r, RankState.DONE, returncode=0, log_path=run / f"rank-{r}.log") for r in (0, 1)]
    result = JobResult(_spec(), run, ranks, status=JobStatus.FINISHED, alerts=[straggler])
    record.end(result, None)
    assert DistributedCall.from_run_dir(run).alerts == [straggler]
