"""The rules of the watch: which rank straggles and why, which rank hangs; plain logic, no process, no clock.

Fed what each rank's file says (launch/files/step_times.py) and the time of
the reading, `Detector` answers with new `Alert`s (job.py). The rules, and
why their thresholds are what they are, are in docs/watching.md:

- Straggler. Over the last `WINDOW` steps that every running rank finished,
  a rank lags in a step when its input wait exceeds the median of the other
  ranks' by more than `max(LAG_SECONDS, LAG_SHARE x the step)`, or when its
  own time (input + compute) does. Input wait is never inflated by a peer;
  compute may be (DDP's all-reduce runs inside backward()), which is why a
  rank whose compute is long only because it waited for an input-slow peer
  is not named: its own time is no longer than the others'. A rank lagging
  in at least `MAJORITY` of the window is named once per cause, with the
  median of its lags.
- Hang. A rank is stalled when it has made no progress (a batch, a step, a
  collective entered or left) for `max(hang_after, HANG_STEPS x the median
  step)`. It is named when another rank waits in (or last called, on NCCL) a
  collective that it has not reached: by the collectives counted, it is
  behind. Equal counts (every rank between two collectives in a long step)
  are no hang. Each stall is named once.

Not for: reading files, asking for stacks, acting (watching/listener.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from ..job import Alert
from ..launch.files.step_times import RankSteps, Step

#: Steps the straggler rule looks at (the newest every running rank finished).
WINDOW = 20
#: Share of the window in which a rank must lag to be named.
MAJORITY = 0.6
#: A lag counts above this many seconds, and above this share of the step's median time.
LAG_SECONDS = 0.05
LAG_SHARE = 0.2
#: A hang is named after this many seconds without progress at least (AIR_MAGIC_HANG_AFTER changes it) ...
HANG_AFTER = 30.0
#: ... or after this many usual steps, when that is longer.
HANG_STEPS = 5
#: Steps kept per rank between readings.
_KEEP = 256


@dataclass(frozen=True)
class Lag:
    """A rank named by the straggler rule: its cause, its median lag per step, and in how many steps it lagged."""

    rank: int
    cause: str
    seconds: float
    steps: int
    window: int


def _median_others(values: dict[int, float], rank: int) -> float:
    return statistics.median(v for r, v in values.items() if r != rank)


def find_stragglers(steps: dict[int, dict[int, Step]], window: int = WINDOW) -> list[Lag]:
    """The ranks that lag in at least MAJORITY of the last `window` steps every rank of `steps` finished."""
    if len(steps) < 2:
        return []
    common = set.intersection(*(set(by_index) for by_index in steps.values()))
    indices = sorted(common)[-window:]
    if len(indices) < window:
        return []
    lags: dict[int, list[tuple[str, float]]] = {rank: [] for rank in steps}
    for index in indices:
        at = {rank: by_index[index] for rank, by_index in steps.items()}
        inputs = {r: s.input for r, s in at.items()}
        computes = {r: s.compute for r, s in at.items()}
        own = {r: s.input + s.compute for r, s in at.items()}
        threshold = max(LAG_SECONDS, LAG_SHARE * statistics.median(s.total for s in at.values()))
        for rank in at:
            input_lag = inputs[rank] - _median_others(inputs, rank)
            own_lag = own[rank] - _median_others(own, rank)
            if input_lag > threshold:
                lags[rank].append(("input", input_lag))
            elif own_lag > threshold:
                compute_lag = computes[rank] - _median_others(computes, rank)
                lags[rank].append(("input" if input_lag > compute_lag else "compute", own_lag))
    found = []
    for rank, lagged in sorted(lags.items()):
        if len(lagged) >= MAJORITY * len(indices):
            causes = [cause for cause, _ in lagged]
            cause = max(("input", "compute"), key=causes.count)
            seconds = statistics.median(lag for c, lag in lagged if c == cause)
            found.append(Lag(rank, cause, seconds, len(lagged), len(indices)))
    return found


def hang_threshold(states: dict[int, RankSteps], hang_after: float = HANG_AFTER) -> float:
    """Seconds without progress from which a rank is hung: hang_after, or HANG_STEPS usual steps if longer."""
    totals = [s.total for state in states.values() for s in state.recent[-WINDOW:]]
    usual = statistics.median(totals) if totals else 0.0
    return max(hang_after, HANG_STEPS * usual)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


class Detector:
    """Keeps what the ranks' files said and names each straggler and each hang once; see the module."""

    def __init__(self, world_size: int, hang_after: float = HANG_AFTER, window: int = WINDOW) -> None:
        self.world_size = world_size
        self.hang_after = hang_after
        self.window = window
        self.states: dict[int, RankSteps] = {}
        self.steps: dict[int, dict[int, Step]] = {}
        #: rank -> (the `now` of its file, when this reader first saw that file: the reader's clock).
        self.seen: dict[int, tuple[float, float]] = {}
        self.named: set[tuple[str, int, object]] = set()
        self.lags: dict[int, Lag] = {}

    def reset(self) -> None:
        """A new attempt: its ranks are judged on their own."""
        self.states.clear()
        self.steps.clear()
        self.seen.clear()
        self.lags.clear()
        self.named = {key for key in self.named if key[0] == "straggler"}  # a cause once named is not named again

    def update(self, rank: int, state: RankSteps, now: float) -> None:
        """What rank `rank`'s file says, read at `now` (the reader's clock, seconds)."""
        if self.seen.get(rank, (None,))[0] != state.now:
            self.seen[rank] = (state.now, now)
        self.states[rank] = state
        kept = self.steps.setdefault(rank, {})
        for step in state.recent:
            kept[step.index] = step
        if len(kept) > _KEEP:
            for index in sorted(kept)[: len(kept) - _KEEP]:
                del kept[index]

    def stalled_for(self, rank: int, now: float) -> float:
        """Seconds rank `rank` has made no progress, by its own clock and the time since its file last changed."""
        state = self.states[rank]
        return max(0.0, state.now - state.progress) + max(0.0, now - self.seen[rank][1])

    def check(self, now: float, wall: float, running: set[int] | None = None) -> list[Alert]:
        """New alerts, given the ranks still running (None: every rank with a file)."""
        ranks = set(self.states) if running is None else set(self.states) & running
        alerts = self._stragglers(ranks, wall)
        alerts += self._hangs(ranks, now, wall)
        return alerts

    def final(self, wall: float) -> list[Alert]:
        """Once the ranks have ended: new straggler alerts among every rank that left steps (no hang: they all
        stopped), so that steps read last, or a run shorter than the readings' lag, are judged too."""
        return self._stragglers(set(self.states), wall)

    def _stragglers(self, ranks: set[int], wall: float) -> list[Alert]:
        self.lags = {}
        alerts = []
        for lag in find_stragglers({r: self.steps[r] for r in ranks if self.steps.get(r)}, self.window):
            self.lags[lag.rank] = lag
            key = ("straggler", lag.rank, lag.cause)
            if key in self.named:
                continue
            self.named.add(key)
            message = (
                f"rank {lag.rank} is a straggler: {lag.seconds:.2f} s per step behind the others, slower in "
                + ("its input (DataLoader)" if lag.cause == "input" else "its compute")
                + f", in {lag.steps} of the last {lag.window} steps"
            )
            alerts.append(Alert("straggler", lag.rank, lag.cause, message, wall, lag.seconds))
        return alerts

    def waiting(self, ranks: set[int]) -> dict[int, tuple[str, int, bool]]:
        """rank -> (collective, its number, in it now) for the ranks that wait in one or last called one."""
        found = {}
        for rank in ranks:
            state = self.states[rank]
            coll = state.waiting
            if coll is not None:
                found[rank] = (coll.op, coll.number, state.collective is not None)
        return found

    def threshold(self) -> float:
        return hang_threshold(self.states, self.hang_after)

    def _hangs(self, ranks: set[int], now: float, wall: float) -> list[Alert]:
        waiting = self.waiting(ranks)
        if not waiting:
            return []
        limit = self.threshold()
        alerts = []
        for rank in sorted(ranks):
            state = self.states[rank]
            stalled = self.stalled_for(rank, now)
            if state.collective is not None or stalled < limit:
                continue
            ahead = sorted(r for r, (_, number, _) in waiting.items() if r != rank and number > state.calls)
            if not ahead:
                continue
            key = ("hang", rank, state.progress)
            if key in self.named:
                continue
            self.named.add(key)
            op, number, inside = waiting[ahead[0]]
            others = ", ".join(str(r) for r in ahead)
            verb = ("wait in" if len(ahead) > 1 else "waits in") if inside else "last called"
            since = wall - stalled
            message = (
                f"rank {rank} hangs: no progress for {stalled:.0f} s (since {_clock(since)}), while rank"
                f"{'s' if len(ahead) > 1 else ''} {others} {verb} {op} #{number}, which rank {rank} never reached"
            )
            alerts.append(Alert("hang", rank, "no progress", message, wall, stalled))
        return alerts

    def near_hang(self, ranks: set[int], now: float, share: float = 0.5) -> list[int]:
        """Ranks the hang rule would name once `share` of its time has passed (their stacks are asked for then)."""
        waiting = self.waiting(ranks & set(self.states))
        if not waiting:
            return []
        limit = share * self.threshold()
        return [
            r
            for r in sorted(ranks & set(self.states))
            if self.states[r].collective is None
            and self.stalled_for(r, now) >= limit
            and any(number > self.states[r].calls for o, (_, number, _) in waiting.items() if o != r)
        ]

    def summary(self) -> dict[int, dict[str, float]]:
        """rank -> its last WINDOW steps on average: input, compute, collective, step (seconds); and steps done."""
        out = {}
        for rank, state in sorted(self.states.items()):
            recent = state.recent[-self.window :]
            n = len(recent) or 1
            out[rank] = {
                "steps": float(state.count),
                "input": sum(s.input for s in recent) / n,
                "compute": sum(s.compute for s in recent) / n,
                "collective": sum(s.collective for s in recent) / n,
                "step": sum(s.total for s in recent) / n,
            }
        return out
