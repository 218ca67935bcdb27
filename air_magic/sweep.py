"""`air_magic.sweep(fn, [kwargs, ...])`: one background call per trial, run as GPUs (or CPU slots) free up.

Every trial is spawned at once (calls/handle.py); the ledger (calls/ledger.py) starts each when its GPUs are free,
first come first served. With MLflow on, the trials are child runs of one parent run made for the sweep
(itself a child of the notebook's active run, if there is one), which ends when the last trial does:
FINISHED if every trial finished, else FAILED. `Sweep.chart()` compares the trials' last metric values
(display/compare.py). Not for: choosing trials (a list of keyword arguments is given).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from .calls.handle import DistributedCall
from .decorator import DistributedFunction, distributed
from .errors import ConfigurationError
from .job import CallStatus, JobSpec
from .owner import BACKGROUND, owner


class Sweep:
    """The trials of one sweep: their handles, results, statuses and a chart comparing their last metrics."""

    def __init__(self, name: str, trials: list[dict[str, Any]], calls: list[DistributedCall]) -> None:
        self.name = name
        self.trials = trials
        self.calls = calls
        self.run_id: str | None = None  # the parent MLflow run

    @property
    def statuses(self) -> list[str]:
        return [call.status for call in self.calls]

    def done(self) -> bool:
        return all(call.done() for call in self.calls)

    def results(self, timeout: float | None = None) -> list[Any]:
        """Each trial's per-rank values, or the exception it ended with (in the trials' order)."""
        out: list[Any] = []
        for call in self.calls:
            try:
                out.append(call.result(timeout))
            except TimeoutError:
                raise
            except BaseException as exc:  # noqa: BLE001 - one failed trial is the sweep's data, not its end
                out.append(exc)
        return out

    def last_metrics(self) -> list[dict[str, float]]:
        """For each trial, the last value of every metric its ranks logged (rank 0's first, else another's)."""
        from .display.charts import MetricsTail

        out: list[dict[str, float]] = []
        for call in self.calls:
            if call.ctx is None:
                out.append({})
                continue
            tail = MetricsTail(call.ctx.run_dir, call.spec.world_size)
            tail.poll()
            out.append({key: per_rank[min(per_rank)].points[-1][1] for key, per_rank in tail.series.items()})
        return out

    def labels(self) -> list[str]:
        return [
            ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or f"trial {n}" for n, kwargs in enumerate(self.trials)
        ]

    def chart(self) -> dict[str, str]:
        """One chart comparing the trials: for each metric, a bar per trial with its last value (MIME bundle)."""
        from .display.compare import compare_bundle

        done = sum(call.done() for call in self.calls)
        title = f"sweep {self.name}: {done} of {len(self.calls)} trial(s) ended"
        return compare_bundle(title, list(zip(self.labels(), self.last_metrics(), strict=True)))

    def show(self) -> None:
        """Draw the comparison chart here."""
        from IPython.display import display

        display(self.chart(), raw=True)

    def __repr__(self) -> str:
        return f"<Sweep {self.name}: {len(self.calls)} trial(s), " + ", ".join(self.statuses) + ">"


def _parent_run(spec: JobSpec, name: str) -> tuple[str, Callable[[list[DistributedCall]], None]]:
    """Make the sweep's parent MLflow run, active while the trials are spawned, in the experiment a call would use;
    and what ends it when the trials end."""
    import mlflow

    from .tracking.listener import MlflowTracker
    from .tracking.store import absolute_uri

    experiment_id = None
    if mlflow.active_run() is None:
        tracker = MlflowTracker(spec)
        tracker._read_active()
        tracker.tracking_uri = absolute_uri(mlflow.get_tracking_uri())
        experiment_id = tracker._experiment(mlflow, mlflow.MlflowClient(tracker.tracking_uri))[0]
    run = mlflow.start_run(
        run_name=f"sweep {name}", nested=mlflow.active_run() is not None, experiment_id=experiment_id
    )
    run_id = run.info.run_id

    def end(calls: list[DistributedCall]) -> None:
        for call in calls:
            call._done.wait()
        status = "FINISHED" if all(call.status == CallStatus.FINISHED for call in calls) else "FAILED"
        mlflow.MlflowClient().set_terminated(run_id, status)

    return run_id, end


def sweep(
    fn: DistributedFunction[..., Any] | Callable[..., Any],
    trials: Sequence[dict[str, Any]],
    num_accelerators: int | None = None,
    *,
    name: str | None = None,
    **settings: Any,
) -> Sweep:
    """Run `fn(**kwargs)` for each trial's keyword arguments, in the background, as GPUs or CPU slots free up.

    fn: a `@distributed` function or a plain one; num_accelerators and `settings` (any argument of
    `distributed`) override its settings for every trial. Returns a `Sweep` at once: `.results()` waits for every
    trial, `.chart()` / `.show()` compare their last metrics. With MLflow on, each trial is a child run of one
    parent run for the sweep.
    """
    if not trials or not all(isinstance(t, dict) for t in trials):
        raise ConfigurationError("sweep() takes a list of trials, each a dict of keyword arguments for fn.")
    if not isinstance(fn, DistributedFunction):
        fn = distributed()(fn)
    if num_accelerators is not None:
        settings["num_accelerators"] = num_accelerators
    fn = fn.with_overrides(**settings) if settings else fn
    base = str(getattr(fn.func, "__qualname__", None) or getattr(fn.func, "__name__", "function"))
    name = name or base
    specs = [fn.settings.spec(fn.func, (), dict(kw), f"{base} [trial {n}]") for n, kw in enumerate(trials)]
    parent = _parent_run(specs[0], name) if fn.settings.mlflow else None
    calls: list[DistributedCall] = []
    try:
        for spec in specs:
            calls.append(owner().submit(spec, BACKGROUND))
    finally:
        if parent is not None:
            import mlflow

            mlflow.end_run()  # no longer the notebook's active run; kept RUNNING until the last trial ends
            mlflow.MlflowClient().update_run(parent[0], status="RUNNING")
    result = Sweep(name, [dict(t) for t in trials], calls)
    if parent is not None:
        result.run_id = parent[0]
        threading.Thread(target=parent[1], args=(calls,), name="air_magic-sweep", daemon=True).start()
    return result
