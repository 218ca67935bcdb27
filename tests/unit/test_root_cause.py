"""Which failed rank is the root cause of an attempt's end: judged from what each rank left, never from which end
was seen first."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from fakes import ScriptedLauncher, peer_gone_error

from air_magic.calls import runner
from air_magic.calls.outcome import PEER_GRACE, AttemptOutcome, Blame, raised_in_collective
from air_magic.errors import JobCancelledError, RemoteTraceback, WorkerDiedError
from air_magic.job import JobResult, JobSpec, RankResult, RankState
from air_magic.launch import protocol as p
from air_magic.launch.files.rundir import RunDir
from air_magic.listeners import Listener, RunContext


def _target() -> None:
    return None


def spec(world: int = 2) -> JobSpec:
    return JobSpec(
        target=_target, args=(), kwargs={}, name="f", world_size=world, accelerator_type="CPU", timeout=60, mlflow=False
    )


class Ended(AttemptOutcome):
    """An attempt as the runner leaves it: `left` maps a failed rank to (exit code, its error or None, when)."""

    def __init__(self, tmp: Path, left: dict[int, tuple[int, BaseException | None, float]], world: int = 2) -> None:
        self.spec = spec(world)
        self.run_dir = RunDir(tmp)
        self.logs = [tmp / f"rank{r}.log" for r in range(world)]
        self.result = JobResult(self.spec, tmp, [RankResult(r) for r in range(world)])
        self.attempt, self.stop_reason, self.launch_error = 0, None, None
        self.outcomes, self.exited_at, self.failures = {}, {}, []
        for rank, (code, error, when) in sorted(left.items(), key=lambda item: item[1][2]):  # in the order seen
            self.result.ranks[rank].returncode = code
            self.outcomes[rank] = p.RankOutcome(error=error, error_at=when if error is not None else None)
            self.exited_at[rank] = when + 0.5
            self.failures.append(rank)


def user_error(message: str = "loss is nan") -> ValueError:
    error = ValueError(message)
    error.__cause__ = RemoteTraceback(
        'Traceback (most recent call last):\n  File "/venv/site-packages/torch/distributed/distributed_c10d.py", '
        'line 9, in all_reduce\n  File "/work/train.py", line 3, in step\n    raise ValueError("loss is nan")\n'
    )
    return error


@pytest.mark.parametrize("rank0_first", [True, False])
def test_a_rank_killed_by_a_signal_is_the_cause_whichever_end_was_seen_first(tmp_path, rank0_first):
    """Rank 1 SIGKILLed, rank 0's barrier() failing for it: rank 1's WorkerDiedError, rank 0's error listed after."""
    rank0_at, rank1_at = (1.0, 2.0) if rank0_first else (2.0, 1.0)
    ended = Ended(tmp_path, {0: (1, peer_gone_error(), rank0_at), 1: (-signal.SIGKILL, None, rank1_at)})
    assert ended.by_blame() == [1, 0] and ended.blame(0) == Blame.COLLECTIVE and ended.blame(1) == Blame.CAUSE
    error = ended.outcome_error()
    assert isinstance(error, WorkerDiedError) and str(error).startswith("rank 1 was killed by signal 9 (SIGKILL)")
    (note,) = error.__notes__
    assert note.startswith("other ranks that failed too: rank 0: RuntimeError(") and "Connection closed" in note
    assert ended.first_failure(error) == "rank 1 was killed by signal 9 (SIGKILL)"


def test_a_user_error_seen_after_a_peers_collective_error_is_still_the_cause(tmp_path):
    """An exception raised in the user's code (even called from torch) comes before a collective's error."""
    ended = Ended(tmp_path, {0: (1, peer_gone_error(), 1.0), 1: (1, user_error(), 5.0)})
    error = ended.outcome_error()
    assert isinstance(error, ValueError) and "raised on rank 1 of 2" in error.__notes__[0]
    assert "rank 0: RuntimeError" in error.__notes__[1]


def test_among_causes_and_among_collective_errors_the_first_in_time_wins(tmp_path):
    """Two deaths: the earlier; only collective errors: the earlier, whichever rank it is."""
    deaths = Ended(tmp_path, {0: (-signal.SIGKILL, None, 3.0), 1: (-signal.SIGTERM, None, 1.0), 2: (1, None, 2.0)}, 3)
    assert deaths.by_blame() == [1, 2, 0]
    collectives = Ended(tmp_path, {0: (1, peer_gone_error(), 3.0), 1: (1, peer_gone_error(), 1.0)})
    assert collectives.by_blame() == [1, 0] and "raised on rank 1" in collectives.outcome_error().__notes__[0]


def test_the_stop_waits_for_the_peers_only_while_every_failure_is_a_collective_error(tmp_path):
    """A collective's error alone: PEER_GRACE for its peer's end to be seen; a death or user error: no wait."""
    assert Ended(tmp_path, {0: (1, peer_gone_error(), 1.0)}).stop_grace() == PEER_GRACE
    assert Ended(tmp_path, {1: (-signal.SIGKILL, None, 1.0)}).stop_grace() == 0
    assert Ended(tmp_path, {0: (1, peer_gone_error(), 1.0), 1: (1, user_error(), 2.0)}).stop_grace() == 0


def test_an_error_is_a_collectives_by_its_innermost_frame_its_type_or_else_its_message():
    """torch.distributed's innermost frame or type, or, with no traceback, a peer-gone message; user code is not."""
    import torch.distributed as dist

    assert raised_in_collective(peer_gone_error())
    assert not raised_in_collective(user_error())
    assert raised_in_collective(dist.DistBackendError("NCCL communicator was aborted on rank 0"))
    assert raised_in_collective(RuntimeError("Connection reset by peer"))
    assert not raised_in_collective(RuntimeError("CUDA out of memory"))


def test_the_runner_waits_for_the_peer_whose_death_broke_the_collective(tmp_path, monkeypatch):
    """Rank 0's barrier() error is seen first; rank 1's SIGKILL a poll later still counts as a failure, and is
    raised."""
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path))
    result = runner.run(spec(), [], ScriptedLauncher("peer died"))
    assert isinstance(result.error, WorkerDiedError) and "rank 1 was killed by signal 9" in str(result.error)
    assert "rank 0: RuntimeError" in result.error.__notes__[0]


class _CancelsAtOnce(Listener):
    def on_start(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def on_output(self, rank: int, text: str) -> None:
        self.ctx.cancel()


def test_a_rank_whose_collective_fails_for_a_peer_the_cancel_stopped_is_stopped_not_failed(tmp_path, monkeypatch):
    """Cancel stops rank 0 first; rank 1's all_reduce then fails for it: both ranks read stopped, the call is
    cancelled, and no rank is said to have failed."""
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path))
    result = runner.run(spec(), [_CancelsAtOnce()], ScriptedLauncher("hang, peer lost on stop"))
    assert [r.state for r in result.ranks] == [RankState.STOPPED, RankState.STOPPED]
    assert isinstance(result.error, JobCancelledError), result.error
