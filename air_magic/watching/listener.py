"""The watch of a call: a runner listener that reads the ranks' step files and raises the detector's alerts.

`Watcher` asks every rank to keep its step times (`worker_env`: the rank side
is launch/rank/steps.py) and, on a thread of its own, reads each rank's file
(launch/files/step_times.py) about once a second: the rules are the
detector's (watching/detector.py). What it finds goes where the listeners
that show a call look for it:

- `RunContext.alerts` (the display's line and tab badge, `handle.alerts`, and
  `JobResult.alerts` at the end) and `RunContext.step_times` (each rank's
  input / compute / collective per step, for the panel's table);
- its sinks (the MLflow tracker's `log_system_metrics`), every `LOG_EVERY`
  seconds: `watch/rank_N/input_wait`, `compute`, `collective_wait` (seconds
  per step, over the recent steps) and `straggler_lag` (0 when it does not lag);
- for a rank near the hang rule's time, `RunContext.ask_stacks()` once: the
  runner asks the launcher, which answers in the ranks' logs (and, on GPUs,
  NCCL's flight recorder into `RunContext.collectives`); the stacks read from
  the hung rank's output say where it is in the alert. With `on_hang="stop"`
  or `"restart"`, `RunContext.act_on_hang` hands the hang to the runner.

Reading and judging happen on the watcher's thread, so the runner's loop
never waits for them; the runner's thread only feeds output to the stack
scanner. No IPython, ipywidgets or MLflow here.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping

from .. import envvars
from ..errors import ConfigurationError
from ..job import Alert, JobResult, JobSpec, RankState
from ..launch.files import step_times
from ..launch.files.rundir import RunDir
from ..launch.files.stack_dumps import Dump, StackScanner
from ..listeners import Listener, RunContext
from .detector import HANG_AFTER, Detector

#: Seconds between two readings of the ranks' files.
PERIOD = 1.0
#: Seconds between two samples handed to the sinks (MLflow).
LOG_EVERY = 5.0
#: Seconds a hang's alert waits, at most, for the hung rank's stacks asked for ahead of it.
STACKS_WAIT = 5.0

Sink = Callable[[dict[str, float], int], None]


def hang_after(env: Mapping[str, str] | None = None) -> float:
    """The hang rule's least time, in seconds: AIR_MAGIC_HANG_AFTER of `env` (this process's environment if None),
    else 30."""
    text = (os.environ if env is None else env).get(envvars.HANG_AFTER, "").strip()
    if not text:
        return HANG_AFTER
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigurationError(
            f"{envvars.HANG_AFTER}={text!r} is not a number of seconds more than 0; unset it for the default (30)."
        )
    return seconds


def metrics(summary: dict[int, dict[str, float]], lags: dict[int, float]) -> dict[str, float]:
    """The recent step times as MLflow metrics: `watch/rank_N/input_wait`, `compute`, `collective_wait`,
    `straggler_lag`."""
    out: dict[str, float] = {}
    for rank, times in sorted(summary.items()):
        if not times.get("steps"):
            continue
        key = f"watch/rank_{rank}/"
        out[key + "input_wait"] = round(times["input"], 5)
        out[key + "compute"] = round(times["compute"], 5)
        out[key + "collective_wait"] = round(times["collective"], 5)
        out[key + "straggler_lag"] = round(lags.get(rank, 0.0), 5)
    return out


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def _innermost_native(lines: list[str]) -> str:
    """The first frame py-spy lists under the first thread (its main thread, innermost first), or ""."""
    seen_thread = False
    for line in lines:
        if line.lstrip().startswith("Thread "):
            seen_thread = True
        elif seen_thread and line.strip():
            return line.strip()
    return ""


def where_text(dump: Dump) -> str:
    """'in train (cell 4, line 12); native: ... ' from a rank's stacks."""
    frame = dump.user_frame()
    where = f"in {frame.where()}" if frame is not None else "in no user code"
    native = _innermost_native(dump.native)
    return f"{where}{f' (innermost native frame: {native})' if native else ''}"


class Watcher(Listener):
    """Watches one call (see the module); `sinks` get its sampled metrics."""

    def __init__(self, spec: JobSpec, period: float = PERIOD, log_every: float = LOG_EVERY) -> None:
        self.on_hang = spec.on_hang
        self.hang_after = hang_after()
        self.period = period
        self.log_every = log_every
        self.sinks: list[Sink] = []
        self.sink_error: str | None = None
        self.ctx: RunContext | None = None
        self.detector = Detector(spec.world_size, self.hang_after)
        self.running: set[int] = set()
        self.scanners = [StackScanner() for _ in range(spec.world_size)]
        self.dumps: dict[int, Dump] = {}
        self.asked: set[tuple[int, float]] = set()  # (rank, its last progress) whose stacks were asked for
        self.held: list[tuple[Alert, float]] = []  # hang alerts waiting for their rank's stacks, until (monotonic)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- runner hooks ------------------------------------------------------
    def worker_env(self) -> dict[str, str]:
        return {envvars.WATCH: "1"}

    def on_start(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self._thread = threading.Thread(target=self._loop, name="air_magic-watch", daemon=True)
        self._thread.start()

    def on_rank_state(self, rank: int, state: RankState) -> None:
        with self._lock:
            if state == RankState.RUNNING:
                self.running.add(rank)
            else:
                self.running.discard(rank)

    def on_attempt(self, attempt: int, why: str) -> None:
        with self._lock:
            self.detector.reset()
            self.dumps.clear()
            self.held = []

    def on_output(self, rank: int, text: str) -> None:
        _, dumps = self.scanners[rank].feed(text)
        for dump in dumps:
            if dump.of_rank:
                with self._lock:
                    self.dumps[rank] = dump

    def on_end(self, result: JobResult) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self.look()  # what the ranks wrote last (a straggler named at the very end still counts)
        if self.ctx is not None:
            self.ctx.alerts += [self._where(alert, self.dumps.get(alert.rank)) for alert, _ in self.held]
            self.held = []
        result.alerts = list(self.ctx.alerts) if self.ctx is not None else []
        if self.sink_error is not None:
            warnings.warn(
                f"air_magic: the ranks' step times could not be logged to the run ({self.sink_error}); "
                "the call itself is not affected.",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- the watcher's thread ------------------------------------------------
    def _loop(self) -> None:
        next_log = time.monotonic() + self.log_every
        while not self._stop.wait(self.period):
            try:
                self.look()
            except Exception:  # noqa: BLE001, S112 - a file read wrong now is read again a second later
                continue
            if time.monotonic() >= next_log:
                next_log = time.monotonic() + self.log_every
                self._send()

    def look(self) -> list[Alert]:
        """Read every rank's file once, judge, and raise what is new (the thread calls this every `period`)."""
        ctx = self.ctx
        assert ctx is not None
        run_dir = RunDir(ctx.run_dir)
        now, wall = time.monotonic(), time.time()
        with self._lock:
            running = set(self.running)
            for rank in range(ctx.spec.world_size):
                state = step_times.read(run_dir.steps(rank))
                if state is not None:
                    self.detector.update(rank, state, now)
            alerts = self.detector.check(now, wall, running)
            near = self.detector.near_hang(running, now)
            ctx.step_times = self.detector.summary()
            dumps = dict(self.dumps)
        for rank in near:
            key = (rank, self.detector.states[rank].progress)
            if key not in self.asked:
                self.asked.add(key)
                ctx.ask_stacks()  # the runner asks the launcher; the stacks come back in the ranks' output
        self.held += [(a, now + STACKS_WAIT) for a in alerts if a.kind == "hang"]
        raised = [a for a in alerts if a.kind != "hang"]
        for alert, until in list(self.held):
            dump = dumps.get(alert.rank)
            if (dump is not None and dump.clock >= _clock(alert.time - alert.seconds)) or now >= until:
                self.held.remove((alert, until))
                raised.append(self._where(alert, dump))
        for alert in raised:
            ctx.alerts.append(alert)
            if alert.kind == "hang" and self.on_hang != "report":
                ctx.act_on_hang(alert)
        return raised

    def _where(self, alert: Alert, dump: Dump | None) -> Alert:
        assert self.ctx is not None
        words = alert.message
        words += f"; it is {where_text(dump)}" if dump is not None else "; its stack was asked for (the Stacks view)"
        if self.ctx.collectives:
            words += f"; NCCL's flight recorder: {self.ctx.collectives}"
        return Alert(alert.kind, alert.rank, alert.cause, words, alert.time, alert.seconds)

    def _send(self) -> None:
        if self.ctx is None or self.sink_error is not None:
            return
        lags = {rank: lag.seconds for rank, lag in self.detector.lags.items()}
        values = metrics(self.ctx.step_times, lags)
        if not values:
            return
        step = int(self.ctx.elapsed)
        for sink in self.sinks:
            try:
                sink(values, step)
            except Exception as exc:  # noqa: BLE001 - reported once at the end; watching goes on
                self.sink_error = f"{type(exc).__name__}: {exc}"
