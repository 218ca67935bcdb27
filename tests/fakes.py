"""Fakes shared by the tests: a launcher that plays scripted attempts, without starting any process."""

from __future__ import annotations

import signal
import time

import cloudpickle

from air_magic.errors import RemoteTraceback
from air_magic.launch import protocol as p
from air_magic.launch.files.rundir import RunDir
from air_magic.launch.interface import JobHandle, Launcher

WORLD = 2


class Diverged(Exception):
    """The exception a scripted rank raises."""


def peer_gone_error() -> RuntimeError:
    """What rank 0 records when its peer dies while it waits in barrier(): gloo's error, from inside torch."""
    error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:5")
    error.__cause__ = RemoteTraceback(
        'Traceback (most recent call last):\n  File "/work/f.py", line 4, in f\n    dist.barrier()\n'
        '  File "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 4811, in barrier\n'
        "    work.wait()\nRuntimeError: Connection closed by peer\n"
    )
    return error


class ScriptedJob(JobHandle):
    """One attempt whose ranks do what `plan` says: "ok", "die" (rank 1 SIGKILLed), "raise" (rank 0), "hang",
    "launch failed" (before any rank starts), "peer died" (rank 0's barrier() fails for its peer, rank 1, whose
    SIGKILL is seen one poll later), "hang, peer lost on stop" (hangs; when stopped, rank 0 ends by the signal and rank
    1's collective fails for it)."""

    def __init__(self, request: p.JobRequest, plan: str) -> None:
        self.job, self.attempt = request.job_id, request.restart_count
        self.pending: list[p.Event] = []
        self.running = set(range(WORLD))
        self.dies_late: int | None = None
        self.plan = plan
        if plan == "launch failed":
            self.pending += [p.LaunchFailed(self.job, "no room"), p.JobGone(self.job)]
            self.running.clear()
            return
        self.pending += [p.RankStarted(self.job, r, 1000 + r) for r in range(WORLD)]
        self.pending.append(p.RankOutput(self.job, 0, f"rank 0 in attempt {self.attempt}\n"))
        if plan == "ok":
            for r in range(WORLD):
                self.exit(r, 0, p.RankOutcome(value=cloudpickle.dumps((r, self.attempt))))
        elif plan == "die":
            self.exit(1, -signal.SIGKILL, p.RankOutcome())
        elif plan == "raise":
            self.exit(
                0, 1, p.RankOutcome(error=Diverged(f"loss is nan in attempt {self.attempt}"), error_at=time.time())
            )
        elif plan == "peer died":
            self.exit(0, 1, p.RankOutcome(error=peer_gone_error(), error_at=time.time() - 1))
            self.dies_late = 1

    def exit(self, rank: int, code: int, outcome: p.RankOutcome) -> None:
        self.running.discard(rank)
        self.pending.append(p.RankExited(self.job, rank, code, time.time(), outcome))
        if not self.running:
            self.pending.append(p.JobGone(self.job))

    def next_events(self, timeout: float) -> list[p.Event]:
        out, self.pending = self.pending, []
        if not out and self.dies_late in self.running:
            self.exit(self.dies_late, -signal.SIGKILL, p.RankOutcome())  # killed before any stop reached it
            out, self.pending = self.pending, []
        if not out:
            time.sleep(min(timeout, 0.01))
        return out

    def stop(self, reason: str, grace: float, interrupt_after: float | None = None) -> None:
        if self.plan == "hang, peer lost on stop" and self.running == {0, 1}:
            self.exit(0, -signal.SIGTERM, p.RankOutcome())
            self.exit(1, 1, p.RankOutcome(error=peer_gone_error(), error_at=time.time()))
        for rank in sorted(self.running):
            self.exit(rank, -signal.SIGTERM, p.RankOutcome())


class ScriptedLauncher(Launcher):
    """A launcher whose n-th attempt follows the n-th plan (see ScriptedJob); it keeps every request it got."""

    def __init__(self, *plans: str) -> None:
        self.plans = list(plans)
        self.requests: list[p.JobRequest] = []

    def start(self, request: p.JobRequest, run_dir: RunDir) -> JobHandle:
        self.requests.append(request)
        return ScriptedJob(request, self.plans[len(self.requests) - 1])
