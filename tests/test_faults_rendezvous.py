"""The rendezvous port: held from its choice to its use, and a store that dies is a clear error."""

from __future__ import annotations

import os
import re
import socket
import time

import psutil
import pytest
from faults_common import (
    Recorder,
    assert_nothing_left,
    assert_nothing_lost,
    procs,
    run_here,
)

pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]


# -- 7. the rendezvous port ------------------------------------------------------------------------


def _try_to_take_the_port() -> dict:
    import os

    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    taken = {}
    for host in ("127.0.0.1", "0.0.0.0"):
        s = socket.socket()
        try:
            s.bind((host, port))
            taken[host] = "bound"
        except OSError as exc:
            taken[host] = exc.errno
        finally:
            s.close()
    dist.init_process_group("gloo")
    # Both ranks are in the group before either returns: a rank that leaves the moment its own side of gloo's mesh is
    # up can close a pair the other rank is still connecting ("Connection closed by peer").
    dist.barrier()
    print(f"rank {dist.get_rank()} joined on {port}", flush=True)
    return {"port": port, "taken": taken, "world": dist.get_world_size()}


def test_the_master_port_is_held_from_choice_to_use_so_no_program_can_take_it():
    """MASTER_PORT is bound by the launcher before any rank starts: another program cannot take it, and ranks still
    join."""
    import errno

    before = procs()
    rec = Recorder()
    result = run_here(_try_to_take_the_port, listener=rec)
    for value in result.values:
        assert value["taken"] == {"127.0.0.1": errno.EADDRINUSE, "0.0.0.0": errno.EADDRINUSE}
        assert value["world"] == 2
    assert_nothing_left(before)
    port = result.values[0]["port"]
    assert_nothing_lost(result.run_dir, {r: [f"rank {r} joined on {port}"] for r in (0, 1)})


def _joins_late() -> int:
    import os
    import time

    import torch.distributed as dist

    print(f"rank {os.environ['RANK']} will join on {os.environ['MASTER_PORT']}", flush=True)
    time.sleep(1.5)
    dist.init_process_group("gloo")
    return dist.get_rank()


class _KillsTheStore(Recorder):
    """Kills whatever listens on the job's MASTER_PORT (the store) once both ranks have named the port: waiting for
    both, not the first, is what lets the test check that neither rank's line is lost, however late a busy machine
    starts the second rank."""

    def on_output(self, rank: int, text: str) -> None:
        super().on_output(rank, text)
        said = {r: "".join(pieces) for r, pieces in self.text.items()}
        named = [r for r, seen in said.items() if re.search(r"will join on \d+\s", seen)]
        if self.cancelled_at is None and sorted(named) == [0, 1]:
            port = int(re.search(r"will join on (\d+)\s", said[0]).group(1))
            for conn in psutil.net_connections("tcp"):
                if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                    os.kill(conn.pid, 9)
                    self.cancelled_at = time.time()


def test_a_rendezvous_store_that_dies_stops_the_job_with_a_clear_message_instead_of_a_long_wait():
    """If the store on MASTER_PORT is killed before the ranks join, the call fails at once and says so."""
    before = procs()
    rec = _KillsTheStore()
    with pytest.raises(Exception, match="rendezvous store") as info:
        run_here(_joins_late, listener=rec, timeout=120)
    assert rec.cancelled_at is not None
    assert "was killed by signal 9" in str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert_nothing_left(before)
    assert rec.result is not None
    assert_nothing_lost(rec.result.run_dir, {r: [f"rank {r} will join on"] for r in (0, 1)})
