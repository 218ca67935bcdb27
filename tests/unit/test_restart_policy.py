"""The runner's restart policy against a scripted launcher: which failures start the world again, and what comes
back."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes import WORLD, Diverged, ScriptedLauncher

from air_magic import distributed
from air_magic.calls import runner
from air_magic.decorator import Settings, check_max_restarts
from air_magic.display.record import record_bundle
from air_magic.display.tail import TailBuffer
from air_magic.errors import ConfigurationError, DistributedTimeoutError, JobCancelledError, WorkerDiedError
from air_magic.job import JobResult, JobSpec, JobStatus, RankState, StopReason
from air_magic.launch.files.rundir import ERROR_RESERVE, RunDir
from air_magic.listeners import Listener, RunContext


class Heard(Listener):
    def __init__(self, cancel_in_attempt: int | None = None) -> None:
        self.attempts: list[tuple[int, str]] = []
        self.states: list[tuple[int, RankState]] = []
        self.cancel_in_attempt = cancel_in_attempt
        self.result: JobResult | None = None

    def on_start(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def on_attempt(self, attempt: int, why: str) -> None:
        self.attempts.append((attempt, why))

    def on_rank_state(self, rank: int, state: RankState) -> None:
        self.states.append((rank, state))
        if state == RankState.RUNNING and self.ctx.attempt == self.cancel_in_attempt:
            self.ctx.cancel()

    def on_end(self, result: JobResult) -> None:
        self.result = result


@pytest.fixture(autouse=True)
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path))
    return tmp_path


def _target() -> None:
    return None


def call(
    launcher: ScriptedLauncher, max_restarts: int, timeout: float | None = 60, heard: Heard | None = None
) -> JobResult:
    spec = JobSpec(
        target=_target,
        args=(),
        kwargs={},
        name="f",
        world_size=WORLD,
        accelerator_type="CPU",
        timeout=timeout,
        mlflow=False,
        max_restarts=max_restarts,
    )
    return runner.run(spec, [heard or Heard()], launcher)


def test_a_rank_that_died_starts_the_world_again_and_the_second_attempt_answers():
    """A SIGKILLed rank with a restart left: a new job with the next restart count, its values, 2 attempts, marked
    log."""
    launcher, heard = ScriptedLauncher("die", "ok"), Heard()
    result = call(launcher, max_restarts=1, heard=heard)
    assert result.error is None and result.status == JobStatus.FINISHED
    assert result.values == [(0, 1), (1, 1)] and result.attempts == 2
    assert [(r.restart_count, r.max_restarts) for r in launcher.requests] == [(0, 1), (1, 1)]
    assert launcher.requests[0].job_id != launcher.requests[1].job_id
    assert heard.attempts == [(1, "rank 1 was killed by signal 9 (SIGKILL)")]
    assert result.earlier_failures == ["rank 1 was killed by signal 9 (SIGKILL)"]
    assert (1, RankState.PENDING) in heard.states[heard.states.index((1, RankState.FAILED)) :]
    log = result.ranks[0].log_path.read_text()  # type: ignore[union-attr]
    assert "attempt 2 of 2; every rank starts again after: rank 1 was killed by signal 9 (SIGKILL)" in log


def test_without_restarts_the_first_failure_ends_the_call():
    """max_restarts=0: the died rank is a WorkerDiedError after one attempt, with no note of earlier ones."""
    launcher = ScriptedLauncher("die", "ok")
    result = call(launcher, max_restarts=0)
    assert isinstance(result.error, WorkerDiedError) and result.status == JobStatus.FAILED
    assert len(launcher.requests) == 1 and result.attempts == 1
    assert not any("earlier attempts" in n for n in getattr(result.error, "__notes__", []))


def test_a_rank_that_always_raises_uses_every_restart_then_its_exception_lists_the_earlier_ones():
    """Three attempts for max_restarts=2, then the last attempt's own exception with each earlier failure noted."""
    launcher = ScriptedLauncher("raise", "raise", "raise")
    result = call(launcher, max_restarts=2)
    assert isinstance(result.error, Diverged) and "attempt 2" in str(result.error)
    assert result.attempts == 3 and result.status == JobStatus.FAILED
    notes = "\n".join(result.error.__notes__)
    assert "raised on rank 0 of 2" in notes
    assert "attempt 1: rank 0 raised Diverged: loss is nan in attempt 0" in notes
    assert "attempt 2: rank 0 raised Diverged: loss is nan in attempt 1" in notes


def test_a_launch_that_started_no_rank_is_not_restarted():
    """A job the launcher could not start (no rank ran) fails at once, whatever max_restarts says."""
    launcher = ScriptedLauncher("launch failed", "ok")
    result = call(launcher, max_restarts=3)
    assert result.status == JobStatus.FAILED and "no room" in str(result.error)
    assert len(launcher.requests) == 1


def test_cancel_is_never_restarted():
    """Cancel during an attempt with restarts left ends the call as cancelled, in that attempt."""
    launcher = ScriptedLauncher("die", "hang", "ok")
    result = call(launcher, max_restarts=2, heard=Heard(cancel_in_attempt=1))
    assert isinstance(result.error, JobCancelledError) and result.status == JobStatus.KILLED
    assert len(launcher.requests) == 2 and result.attempts == 2
    assert "attempt 1: rank 1 was killed" in "\n".join(result.error.__notes__)


def test_the_timeout_covers_every_attempt():
    """The time limit counts from the call's start: a restarted attempt that hangs ends at it, KILLED, not restarted."""
    launcher = ScriptedLauncher("die", "hang", "ok")
    result = call(launcher, max_restarts=2, timeout=1.0)
    assert isinstance(result.error, DistributedTimeoutError) and result.status == JobStatus.KILLED
    assert len(launcher.requests) == 2


def test_begin_attempt_keeps_the_earlier_attempts_files_apart_and_marks_each_log(runs_dir: Path):
    """Results, error records, payload and job file move to attempt-0/; a log cut mid-line gets its marker on a new
    line."""
    rd = RunDir.create("f", 2)
    rd.result(0).write_bytes(b"old result")
    rd.error(1).write_text("{}")
    rd.error_reserve(1).unlink()
    rd.payload.write_bytes(b"payload")
    rd.log(0).write_text("epoch 3 step 12")
    rd.log(1).write_text("done\n")
    rd.begin_attempt(1, 2, "=== marker ===\n")
    kept = rd.attempt(0)
    assert sorted(f.name for f in kept.iterdir()) == ["payload.pkl", "rank-0.result.pkl", "rank-1.error.json"]
    assert not rd.result(0).exists() and not rd.error(1).exists() and not rd.payload.exists()
    assert rd.log(0).read_text() == "epoch 3 step 12\n=== marker ===\n"
    assert rd.log(1).read_text() == "done\n=== marker ===\n"
    assert all(rd.error_reserve(r).stat().st_size == ERROR_RESERVE for r in range(2))


def test_stop_reasons_say_which_ones_the_caller_chose():
    """Cancel, Ctrl-C and the timeout are the caller's (never restarted); a failed rank or launch are not."""
    assert {r for r in StopReason if r.by_caller} == {StopReason.CANCELLED, StopReason.INTERRUPTED, StopReason.TIMEOUT}


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_max_restarts_must_be_a_whole_number_from_zero(bad):
    """max_restarts other than a whole number from 0 is refused at decoration, naming the value."""
    with pytest.raises(ConfigurationError, match="max_restarts must be a whole number"):
        distributed(1, "CPU", max_restarts=bad)
    with pytest.raises(ConfigurationError):
        check_max_restarts(bad)
    assert Settings(max_restarts=3).spec(_target, (), {}, "f").max_restarts == 3


def test_the_record_names_the_attempt_and_how_each_earlier_one_ended(runs_dir: Path):
    """The static record says 'attempt 2 of 3' and lists the earlier attempt's failure, in HTML and text."""
    result = call(ScriptedLauncher("die", "ok"), max_restarts=2)
    bundle = record_bundle(result, [TailBuffer() for _ in range(WORLD)], [r.log_path for r in result.ranks], None)  # type: ignore[misc]
    for kind in ("text/html", "text/plain"):
        assert "attempt 2 of 3" in bundle[kind]
        assert "attempt 1: rank 1 was killed by signal 9 (SIGKILL)" in bundle[kind]
