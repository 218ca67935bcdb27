"""What a Ray call's ranks send back, kept in the call's run directory here as a local rank's files are.

Each actor's poll answers with the bytes its rank wrote since the offsets
asked: its output (appended to `rank-N.log`, then read back into text by the
same `LogTail` the local launcher uses), the MLflow lines its relay wrote (for
the notebook's MLflow listener), its chart lines (for the live charts and
the record), its step-times file (for the watch) and what a command run's node
wrote in its run directory (files/node_mirror.py: its ranks' logs, step times,
usage and stacks, its alerts). At the end it sends its result and error files,
which are written here and read into the rank's outcome as a local rank's are
(rank_files.outcome). This module asks Ray for nothing; the pump does.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import protocol as p
from ..files import node_mirror, step_times
from ..files.rank_files import LogTail, outcome, write_usage
from ..files.rundir import RunDir, write_private


class Received:
    """Every rank's log, MLflow lines and chart lines received so far, and where the next poll starts."""

    def __init__(self, run_dir: RunDir, world_size: int) -> None:
        self.run_dir = run_dir
        self.tails = [LogTail(run_dir.log(r)) for r in range(world_size)]
        #: Per rank: bytes received of its log, its MLflow lines and its chart lines.
        self.sizes = [[0, 0, 0] for _ in range(world_size)]

    def offsets(self, rank: int) -> tuple[int, int, int]:
        """Where the rank's next poll starts in each of its three files."""
        log, metrics, charts = self.sizes[rank]
        return log, metrics, charts

    def take(self, rank: int, report: p.RankReport) -> list[str]:
        """Keep what a poll brought; the new text of the rank's output."""
        rd = self.run_dir
        for slot, data, path in (
            (0, report.output, rd.log(rank)),
            (1, report.metrics, rd.metrics(rank)),
            (2, report.charts, rd.chart_metrics(rank)),
        ):
            if data:
                self.sizes[rank][slot] += len(data)
                _append(path, data)
        if report.usage is not None:
            write_usage(rd.usage(rank), report.usage)
        if report.steps is not None:
            step_times.write_bytes(rd.steps(rank), report.steps)
        if report.node_files:
            node_mirror.apply(rd.path, report.node_files)
        return self.tails[rank].read_all() if report.output else []

    def rest(self, rank: int) -> list[str]:
        """The last of the rank's output text (a character cut at the end of the last piece)."""
        return self.tails[rank].read_all(final=True)

    def outcome(self, rank: int, files: p.RankFiles) -> p.RankOutcome:
        """Write the result and error files the rank sent, and read them into its outcome."""
        rd = self.run_dir
        for data, path in (
            (files.result, rd.result(rank)),
            (files.error, rd.error(rank)),
            (files.error_pickle, rd.error_pickle(rank)),
        ):
            if data is not None:
                write_private(path, data, exclusive=False)
        names = {p.name: p for p in rd.carried_back(rank)}
        for name, data in files.left.items():
            if name in names:  # only the files a rank may leave, by their own names
                write_private(names[name], data, exclusive=False)
        return outcome(rd, rank, error_at=files.error_at)


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
