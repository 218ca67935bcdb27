"""The runner listener of a GPU call's memory: it asks the ranks for CUDA's allocation history (`memory_history=True`)
and puts each rank's peak allocated memory of the call on its `RankResult` (`gpu_peak_allocated`) for the record.

The rank's side (the history, the out-of-memory note and snapshot, the peak) is launch/rank/memory.py; the files
between them launch/files/memory_snapshot.py. No IPython, ipywidgets, MLflow or CUDA here.
"""

from __future__ import annotations

from .. import envvars
from ..job import JobResult, JobSpec
from ..launch.files.memory_snapshot import read_peak
from ..launch.files.rundir import RunDir
from ..listeners import Listener


class MemoryReport(Listener):
    """See the module."""

    def __init__(self, spec: JobSpec) -> None:
        self.history = spec.memory_history

    def worker_env(self) -> dict[str, str]:
        return {envvars.MEMORY_HISTORY: "1"} if self.history else {}

    def on_end(self, result: JobResult) -> None:
        run = RunDir(result.run_dir)
        for rank in result.ranks:
            peak = read_peak(run.memory(rank.rank))
            if peak is not None:
                rank.gpu_peak_allocated = peak["peak_allocated"]
