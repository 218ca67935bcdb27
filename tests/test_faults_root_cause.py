"""A rank that dies without an exception is the error raised, not the peer whose collective its death broke
(gloo's "Connection reset by peer"), whichever of the two ends the notebook sees first."""

from __future__ import annotations

import pytest
from faults_common import assert_nothing_left, procs, run_here

from air_magic.errors import WorkerDiedError

pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]

#: Calls in a row: the order in which the two ends are seen changes from call to call.
RUNS = 5


def _killed_while_its_peer_waits_in_barrier() -> None:
    import os
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would: no exception, no error file
    dist.barrier()


def test_a_sigkilled_rank_is_raised_before_its_peers_collective_error_in_every_run():
    """Each of RUNS calls raises rank 1's WorkerDiedError; rank 0's error, if it came, is only listed after it."""
    before = procs()
    raised: list[str] = []
    for _ in range(RUNS):
        with pytest.raises(WorkerDiedError) as caught:
            run_here(_killed_while_its_peer_waits_in_barrier, accelerator_type="CPU", timeout=120)
        raised.append(str(caught.value).splitlines()[0])
        notes = getattr(caught.value, "__notes__", [])
        assert all("rank 1" not in note for note in notes), notes
        assert all(note.startswith("other ranks that failed too: rank 0: ") for note in notes), notes
    assert all(line.startswith("rank 1 was killed by signal 9 (SIGKILL)") for line in raised), raised
    assert_nothing_left(before)
