"""The watch's rules (watching/detector.py), its file (launch/files/step_times.py) and options, with no process."""

from __future__ import annotations

import random

import pytest

from air_magic.decorator import Settings
from air_magic.errors import ConfigurationError
from air_magic.launch.files import step_times as f
from air_magic.launch.rank import steps as rank_steps
from air_magic.watching import listener
from air_magic.watching.detector import HANG_AFTER, Detector, find_stragglers, hang_threshold

WALL = 1_800_000_000.0


def _state(rank: int, steps: list[f.Step], **kw: object) -> f.RankSteps:
    fields: dict[str, object] = {"pid": 100 + rank, "now": WALL, "count": len(steps), "progress": WALL, "calls": 0}
    fields.update(kw)
    return f.RankSteps(rank=rank, recent=tuple(steps[-f.KEPT :]), **fields)  # type: ignore[arg-type]


class Loop:
    """A synthetic run of `world` ranks: per step, each rank's input, own compute, and a synchronizing wait."""

    def __init__(self, world: int, seed: int = 0, busy: bool = False) -> None:
        self.world = world
        self.rng = random.Random(seed)
        self.busy = busy
        self.steps: dict[int, list[f.Step]] = {r: [] for r in range(world)}

    def noise(self) -> float:
        value = self.rng.uniform(0.0, 0.004)
        if self.busy and self.rng.random() < 0.15:  # both cores busy: now and then a rank is not scheduled
            value += self.rng.uniform(0.01, 0.2)
        return value

    def run(
        self,
        n: int,
        slow_input: dict[int, float] | None = None,
        slow_compute: dict[int, float] | None = None,
        hidden: bool = False,
    ) -> None:
        """`hidden`: the collective runs inside compute (DDP's backward()), so a peer's wait counts as compute."""
        slow_input, slow_compute = slow_input or {}, slow_compute or {}
        for _ in range(n):
            index = len(self.steps[0])
            inputs = {r: 0.002 + slow_input.get(r, 0.0) + self.noise() for r in range(self.world)}
            own = {r: 0.010 + slow_compute.get(r, 0.0) + self.noise() for r in range(self.world)}
            arrive = {r: inputs[r] + own[r] for r in range(self.world)}
            last = max(arrive.values())
            for r in range(self.world):
                wait = last - arrive[r] + 0.0005
                total = inputs[r] + own[r] + wait
                collective = 0.0 if hidden else wait
                self.steps[r].append(f.Step(index, total, inputs[r], collective))

    def feed(self, detector: Detector, now: float = 0.0) -> list:
        alerts = []
        for r in range(self.world):
            detector.update(r, _state(r, self.steps[r], count=len(self.steps[r])), now)
        alerts += detector.check(now, WALL)
        return alerts


def _drive(loop: Loop, total: int, every: int = 10, **slow: object) -> list[tuple[int, object]]:
    """Run `total` steps, the detector reading every `every` steps; (step when seen, alert) for each alert."""
    detector = Detector(loop.world)
    seen = []
    for done in range(every, total + 1, every):
        loop.run(every, **slow)  # type: ignore[arg-type]
        seen += [(done, alert) for alert in loop.feed(detector, now=float(done))]
    return seen


def test_the_file_round_trips():
    """What a rank writes is what the notebook reads: steps, totals, its collective now and the last called."""
    state = f.RankSteps(
        rank=1, pid=42, now=WALL + 3.5, count=7, progress=WALL + 1.25, calls=9,
        input_total=0.5, collective_total=0.25, step_total=2.0,
        collective=f.Collective("all_reduce", 9, WALL + 1.25), after=f.Collective("barrier", 8, WALL),
        recent=(f.Step(5, 0.3, 0.1, 0.05), f.Step(6, 0.25, 0.0, 0.0)),
    )  # fmt: skip
    assert f.decode(f.encode(state)) == state
    assert state.recent[0].compute == pytest.approx(0.15)
    assert f.decode(b"{not json") is None and f.decode(b'{"v": 99}') is None


def test_the_file_is_replaced_whole(tmp_path):
    """`write` replaces the file with mode 0600 and leaves no temporary file; `read` of a missing file is None."""
    path = tmp_path / "rank-0.steps.json"
    assert f.read(path) is None
    f.write(path, _state(0, [f.Step(0, 1.0, 0.5, 0.1)]))
    f.write(path, _state(0, [f.Step(0, 1.0, 0.5, 0.1), f.Step(1, 2.0, 0.0, 0.0)]))
    assert f.read(path) is not None and len(f.read(path).recent) == 2  # type: ignore[union-attr]
    assert oct(path.stat().st_mode & 0o777) == "0o600" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_the_rank_side_adds_up_steps_and_collectives(tmp_path):
    """A step ends where the next begins; its input and collective time are what was measured inside it."""
    path = tmp_path / "rank-0.steps.json"
    recorder = rank_steps.Recorder(path, 0)
    recorder.boundary(10.0)
    recorder.step_input, recorder.step_collective = 0.2, 0.3
    recorder.boundary(11.0)
    recorder.calls, recorder.current = 1, ("all_reduce", 1, 11.5)
    recorder.flush()
    state = f.read(path)
    assert state is not None and state.count == 1 and state.calls == 1
    assert state.recent == (f.Step(0, 1.0, 0.2, 0.3),) and state.collective is not None
    assert state.collective.op == "all_reduce" and state.collective.number == 1


def test_a_stall_written_twice_is_the_same_stall_and_named_once(tmp_path, monkeypatch):
    """A rank's unchanged state written again (as at a stop, or by a flush that raced a change) gives the same times,
    however the wall clock moved against the rank's clock meanwhile; the hang rule names that stall once."""
    path = tmp_path / "rank-1.steps.json"
    recorder = rank_steps.Recorder(path, 1)
    recorder.calls, recorder.after = 5, (rank_steps.DDP_ALL_REDUCE, 5, recorder.progress)
    recorder.changes += 1
    recorder.flush()
    first = f.read(path)
    real = rank_steps.time.time
    monkeypatch.setattr(rank_steps.time, "time", lambda: real() + 0.5)  # a busy machine or a clock step between
    recorder.changes += 1
    recorder.flush()
    again = f.read(path)
    assert first is not None and again is not None and first.after is not None and again.after is not None
    assert (again.progress, again.after.since) == (first.progress, first.after.since)
    detector = Detector(2, hang_after=3.0)
    waiting = _state(0, [], progress=first.progress, calls=6, collective=f.Collective("all_reduce", 6, first.progress))
    alerts = []
    for at, state in ((10.0, first), (20.0, again)):
        detector.update(0, waiting, now=at)
        detector.update(1, state, now=at)
        alerts += detector.check(at + 5.0, WALL)
    assert [(a.kind, a.rank) for a in alerts] == [("hang", 1)]


def test_step_outside_a_watched_rank_does_nothing():
    """air_magic.step() in the notebook (no watched call) is a no-op."""
    rank_steps.step()


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "both cores busy"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_balanced_run_raises_no_alert(world, busy):
    """300 balanced steps, on a quiet or a busy machine (ranks now and then late by up to 0.2 s): no alert."""
    for seed in range(3):
        assert _drive(Loop(world, seed=seed, busy=busy), 300) == []


@pytest.mark.parametrize("hidden", [False, True], ids=["explicit all_reduce", "DDP (wait inside backward)"])
def test_a_rank_slow_in_its_input_is_named_with_cause_input(hidden):
    """Rank 1 slowed 0.12 s a step in its DataLoader: named, cause input, before step 150 of 300; rank 0 never.

    Under DDP rank 0's compute grows by rank 1's lag (it waits inside backward()); that does not make it a straggler.
    """
    seen = _drive(Loop(2, busy=True), 300, slow_input={1: 0.12}, hidden=hidden)
    assert [(a.kind, a.rank, a.cause) for _, a in seen] == [("straggler", 1, "input")]
    step, alert = seen[0]
    assert step < 150 and alert.seconds == pytest.approx(0.12, abs=0.03) and "rank 1" in alert.message


def test_a_rank_slow_in_its_compute_is_named_with_cause_compute():
    """Rank 2 of 4 slowed 0.12 s a step in its compute, the others waiting in an all_reduce: named, cause compute."""
    seen = _drive(Loop(4, busy=True), 300, slow_compute={2: 0.12})
    assert [(a.rank, a.cause) for _, a in seen] == [(2, "compute")] and seen[0][0] < 150


def test_a_straggler_is_named_once():
    """A rank that keeps lagging is named once, however often the files are read."""
    seen = _drive(Loop(2), 300, every=1, slow_input={0: 0.2})
    assert [(a.rank, a.cause) for _, a in seen] == [(0, "input")]


def test_steps_not_finished_by_every_rank_are_not_judged():
    """A rank ahead of the others by steps the others have not finished is judged on the steps all finished."""
    assert find_stragglers({0: {i: f.Step(i, 1, 0.5, 0) for i in range(40, 80)}, 1: {}}) == []


def _hang_states(stall_progress: float, now: float) -> dict[int, f.RankSteps]:
    """Rank 0 waits in all_reduce #6 since `stall_progress`; rank 1 did #5 and has done nothing since."""
    steps = [f.Step(i, 0.1, 0.0, 0.01) for i in range(5)]
    return {
        0: _state(0, steps, now=now, progress=stall_progress, calls=6,
                  collective=f.Collective("all_reduce", 6, stall_progress)),
        1: _state(1, steps, now=now, progress=stall_progress, calls=5, after=f.Collective("all_reduce", 5, WALL)),
    }  # fmt: skip


def test_a_hang_is_named_after_the_threshold_and_not_before():
    """Rank 0 waits in all_reduce #6, rank 1 makes no progress: rank 1 is named once it is 30 s without progress."""
    detector = Detector(2)
    for age in (5.0, 29.0):
        for rank, state in _hang_states(WALL - age, WALL).items():
            detector.update(rank, state, now=100.0)
        assert detector.check(100.0, WALL) == []
    assert detector.near_hang({0, 1}, 100.0) == [1]  # its stacks are asked for ahead of the alert
    for rank, state in _hang_states(WALL - 29.0, WALL).items():
        detector.update(rank, state, now=100.0)
    alerts = detector.check(101.5, WALL + 1.5)  # the file unchanged: the time since it was read counts
    assert [(a.kind, a.rank) for a in alerts] == [("hang", 1)]
    assert "rank 1 hangs" in alerts[0].message and "all_reduce #6" in alerts[0].message
    assert alerts[0].seconds == pytest.approx(30.5)
    assert detector.check(200.0, WALL + 100) == []  # named once per stall


def test_ranks_between_two_collectives_in_a_long_step_are_no_hang():
    """Every rank long after the same collective (equal counts): no rank is behind, no hang."""
    steps = [f.Step(0, 0.1, 0.0, 0.01)]
    detector = Detector(2)
    for rank in (0, 1):
        detector.update(rank, _state(rank, steps, progress=WALL - 100, calls=3,
                                     after=f.Collective("all_reduce", 3, WALL - 100)), 0.0)  # fmt: skip
    assert detector.check(0.0, WALL) == []


def test_the_hang_threshold_is_30_s_or_5_usual_steps():
    """max(30 s, 5 x the median step): a run of 10 s steps waits 50 s."""
    short = {0: _state(0, [f.Step(i, 0.5, 0, 0) for i in range(10)])}
    long = {0: _state(0, [f.Step(i, 10.0, 0, 0) for i in range(10)])}
    assert HANG_AFTER == 30.0
    assert hang_threshold(short) == 30.0 and hang_threshold(long) == 50.0 and hang_threshold({}) == 30.0


def test_the_hang_threshold_knob(monkeypatch):
    """AIR_MAGIC_HANG_AFTER lowers or raises the least time; a value that is no number of seconds is refused."""
    monkeypatch.setenv("AIR_MAGIC_HANG_AFTER", "4.5")
    assert listener.hang_after() == 4.5
    monkeypatch.setenv("AIR_MAGIC_HANG_AFTER", "soon")
    with pytest.raises(ConfigurationError, match="AIR_MAGIC_HANG_AFTER"):
        listener.hang_after()
    monkeypatch.delenv("AIR_MAGIC_HANG_AFTER")
    assert listener.hang_after() == 30.0


def test_metrics_per_rank():
    """The sampled MLflow metrics: input_wait, compute, collective_wait and straggler_lag per rank."""
    summary = {1: {"steps": 10.0, "input": 0.12, "compute": 0.01, "collective": 0.002, "step": 0.132}}
    assert listener.metrics(summary, {1: 0.12}) == {
        "watch/rank_1/input_wait": 0.12,
        "watch/rank_1/compute": 0.01,
        "watch/rank_1/collective_wait": 0.002,
        "watch/rank_1/straggler_lag": 0.12,
    }


def test_watch_options_are_checked():
    """on_hang is one of report, stop, restart ("restart" needs max_restarts); watch is a bool."""
    assert Settings(num_accelerators=2, accelerator_type="CPU", on_hang="stop").on_hang == "stop"
    Settings(num_accelerators=2, accelerator_type="CPU", on_hang="restart", max_restarts=1)
    with pytest.raises(ConfigurationError, match="on_hang must be one of 'report', 'stop', 'restart'"):
        Settings(on_hang="kill")
    with pytest.raises(ConfigurationError, match="max_restarts"):
        Settings(on_hang="restart")
    with pytest.raises(ConfigurationError, match="watch must be True or False"):
        Settings(watch="yes")  # type: ignore[arg-type]


def test_a_ray_ranks_step_file_is_kept_here_as_a_local_ranks(tmp_path):
    """The bytes a Ray rank's poll brings back are its file under the same name in the run directory here."""
    from air_magic.launch.files.rundir import RunDir
    from air_magic.launch.protocol import RankReport
    from air_magic.launch.ray.received import Received

    run_dir = RunDir(tmp_path)
    state = _state(1, [f.Step(0, 0.5, 0.1, 0.2)], calls=3)
    Received(run_dir, 2).take(1, RankReport(b"", b"", steps=f.encode(state)))
    assert f.read(run_dir.steps(1)) == state


def test_a_rank_with_no_step_yet_does_not_hide_a_straggler():
    """A running rank that has finished no step (a session's rank that sits the call out) is left out of the rule."""
    loop = Loop(3)
    loop.run(40, slow_input={1: 0.12})
    loop.steps[2] = []
    detector = Detector(3)
    for rank in range(3):
        detector.update(rank, _state(rank, loop.steps[rank]), 0.0)
    assert [(a.rank, a.cause) for a in detector.check(0.0, WALL)] == [(1, "input")]
