"""The runner listener of a profiled call: it asks every rank to profile N steps, and builds the `Profile` at the end.

`Profiler.worker_env` tells the ranks how many steps (launch/rank/profiler.py
does the rest there). When the call ends, `build` reads what each rank left
(analysis.py), writes the merged trace (merge.py) and puts the `Profile` on
`JobResult.profile`, before the display, the record and MLflow tracking read
it (they come after this listener). No IPython, ipywidgets or MLflow here.
"""

from __future__ import annotations

import json
import warnings

from .. import envvars
from ..job import JobResult, JobSpec
from ..launch.files.rundir import RunDir, write_private
from ..listeners import Listener
from . import analysis, merge
from .profile import Profile


def build(run_dir: RunDir, world_size: int, number: int = 0) -> Profile | None:
    """The profile of the call in `run_dir` from what its ranks left (`profile=N`'s, or the `number`th
    `handle.profile()`'s), with the merged trace written; None when no rank left a trace."""
    traces, missing = analysis.load(run_dir, world_size, number)
    if not traces:
        return None
    analysis.align(traces)
    rows = [analysis.breakdown(t) for t in traces]
    slowest, lag = analysis.slowest(rows)
    sizes = {t.path.name: t.path.stat().st_size for t in traces}
    sizes["merged"] = merge.write(traces, run_dir.merged(number))
    profile = Profile(
        ranks=rows,
        slowest=slowest,
        trace=run_dir.merged(number),
        traces=[t.path for t in traces],
        lag=lag,
        top_ops={t.rank: analysis.top_ops(t) for t in traces},
        skew=analysis.skew(traces),
        steps=min(len(t.steps()) for t in traces),
        first_step=min(t.window.first for t in traces),
        missing=missing,
        sizes=sizes,
    )
    write_private(run_dir.profile_summary(number), json.dumps(profile.record(number)).encode(), exclusive=False)
    return profile


class Profiler(Listener):
    """Profiles `spec.profile` steps of every rank of one call (see the module)."""

    def __init__(self, spec: JobSpec) -> None:
        self.steps = spec.profile or 0
        self.world_size = spec.world_size

    def worker_env(self) -> dict[str, str]:
        return {envvars.PROFILE: str(self.steps)}

    def on_end(self, result: JobResult) -> None:
        result.profile = build(RunDir(result.run_dir), self.world_size)
        if result.profile is None and result.error is None:
            warnings.warn(
                f"air_magic: profile={self.steps} found no profiled step on any rank: a step is the watch's (a "
                "DataLoader batch, or an air_magic.step() call), and the counted steps start at the third one; give "
                "the call more steps, or call air_magic.step() at the end of each.",
                RuntimeWarning,
                stacklevel=2,
            )
