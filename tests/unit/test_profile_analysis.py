"""The analysis of profiled steps (profiling/) on small real traces, written in this process by the rank's own window
(launch/rank/profiler.py), and on a hand-built GPU trace; the settings' checks; the table in the record."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from air_magic import ConfigurationError, distributed
from air_magic.decorator import Settings
from air_magic.display.record import record_bundle
from air_magic.display.tail import TailBuffer
from air_magic.job import JobResult, JobSpec, JobStatus, RankResult
from air_magic.launch.files import profile_windows
from air_magic.launch.files.rundir import RunDir
from air_magic.launch.rank.profiler import INPUT, Window, collective_mark
from air_magic.profiling import analysis
from air_magic.profiling.listener import build


def _profiled_rank(run: RunDir, rank: int, input_wait: float, work: Callable[[], object]) -> None:
    """What a rank's step recorder does over 6 step boundaries: step 1 warms the profiler up, steps 2-4 are counted.
    Each step waits `input_wait` s in a marked DataLoader wait, runs `work`, then a marked 'all_reduce'."""
    window = Window(3, rank, run.trace(rank), run.profile_window(rank))
    for index in range(6):
        window.boundary(index, None if index == 0 else (0.01, input_wait, 0.0))
        mark = window.mark(INPUT)
        time.sleep(input_wait)
        Window.leave(mark)
        work()
        mark = window.mark(collective_mark("all_reduce", index))
        time.sleep(0.001)
        Window.leave(mark)
    window.close()


def _nothing() -> None:
    return None


def _matmuls(n: int, size: int = 64) -> Callable[[], object]:
    x = torch.randn(size, size)
    return lambda: [x @ x for _ in range(n)]


def test_a_rank_slower_in_its_input_is_the_slowest_by_its_input(tmp_path: Path):
    """Two real traces, rank 1 waiting 50 ms for input a step, rank 0 not: rank 1 is the slowest with cause input, each
    split adds up to its step, and the merged trace holds both ranks' steps as processes 0 and 1."""
    run = RunDir(tmp_path)
    _profiled_rank(run, 0, 0.0, _nothing)
    _profiled_rank(run, 1, 0.05, _nothing)
    profile = build(run, 2)
    assert profile is not None and profile.slowest == (1, "input"), profile.table()
    assert profile.steps == 3 and profile.first_step == 2 and profile.lag > 0.0
    rows = {int(r["rank"]): r for r in profile.ranks}
    assert rows[1]["input"] >= 0.05 > rows[0]["input"]
    for row in rows.values():
        assert row["compute"] + row["collective"] + row["input"] == pytest.approx(row["step"], rel=1e-6)
        assert row["collective"] >= 0.001  # the marked wait, on the steps' own thread
    merged = json.loads(run.merged_trace.read_bytes())["traceEvents"]
    for rank in (0, 1):
        marks = [e["name"] for e in merged if e["pid"] == rank and e.get("name", "").startswith("air_magic step")]
        assert marks == ["air_magic step 2", "air_magic step 3", "air_magic step 4"]
    assert min(e["ts"] for e in merged if "ts" in e) >= 0  # one timeline from the earliest event


def test_a_rank_slower_in_its_compute_is_the_slowest_by_its_compute(tmp_path: Path):
    """Rank 0 runs 100 matrix products a step to rank 1's 2: rank 0 is the slowest, cause compute."""
    run = RunDir(tmp_path)
    _profiled_rank(run, 0, 0.0, _matmuls(100, 128))
    _profiled_rank(run, 1, 0.0, _matmuls(2, 128))
    profile = build(run, 2)
    assert profile is not None and profile.slowest == (0, "compute"), profile.table()
    assert "slowest: rank 0 (compute" in profile.table()
    assert profile.top_ops[0][0].name == "aten::mm" and profile.top_ops[0][0].calls == 300  # 100 a step, 3 steps


def test_a_rank_without_a_trace_is_named_with_why(tmp_path: Path):
    """A rank whose call ended before its counted steps says so; no trace at all gives no profile."""
    run = RunDir(tmp_path)
    Window(3, 1, run.trace(1), run.profile_window(1)).close()
    assert build(run, 2) is None
    _profiled_rank(run, 0, 0.0, _nothing)
    profile = build(run, 2)
    assert profile is not None and [int(r["rank"]) for r in profile.ranks] == [0]
    assert profile.missing == {1: "the call ended before a profiled step began"}
    assert "rank 1: no profile (the call ended before a profiled step began)" in profile.table()


def _gpu_trace(path: Path, rank: int, kernels: list[tuple[str, float, float]], host: str = "a") -> None:
    """A trace of one 100 µs step on thread 7 with GPU kernels (name, start, end in µs), as kineto writes them."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "air_magic step 2", "pid": 1, "tid": 7, "ts": 0, "dur": 100}
    ]
    events += [
        {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 20, "ts": s, "dur": e - s} for name, s, e in kernels
    ]
    path.write_text(json.dumps({"baseTimeNanoseconds": 10**15, "host_name": host, "traceEvents": events}))
    window = profile_windows.Window(rank, 1, 1, 2, 7, host, trace=path.name)
    profile_windows.write(path.with_name(f"rank-{rank}.profile.json"), window)


def test_gpu_ranks_split_by_kernels(tmp_path: Path):
    """On a GPU trace: compute is kernel time, collective the NCCL time no other kernel overlaps, idle the time no
    kernel ran (in seconds per step)."""
    run = RunDir(tmp_path)
    _gpu_trace(run.trace(0), 0, [("gemm", 0, 40), ("ncclDevKernel_AllReduce", 30, 90)])
    traces, missing = analysis.load(run, 1)
    assert missing == {}
    row = analysis.breakdown(traces[0])
    assert row == pytest.approx(
        {"rank": 0, "step": 1e-4, "compute": 4e-5, "collective": 5e-5, "input": 0.0, "idle": 1e-5}
    )


def test_a_cpu_ranks_wait_in_its_all_reduce_launch_is_collective_and_overlapped_compute_is_not(tmp_path: Path):
    """A CPU trace of one 100 ms step: the steps' thread (7) computes for 20 ms while a gloo operation runs on thread 9
    (overlapped: compute), then launches the bucket's all-reduce inside autograd's AccumulateGrad, and the launch
    returns only once the reduction on thread 9 is done (a rank waiting for its peer, the launching thread not
    scheduled meanwhile): the 69.7 ms of the reduction inside the launch are collective, not compute."""
    run = RunDir(tmp_path)
    main: list[tuple[str, str, float, float]] = [
        ("user_annotation", "air_magic step 2", 0, 100_000),
        ("cpu_op", "aten::mm", 0, 20_000),
        ("cpu_op", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 20_000, 90_000),
        ("cpu_op", "c10d::allreduce_", 20_100, 89_900),
    ]
    events = [{"ph": "X", "cat": c, "name": n, "pid": 1, "tid": 7, "ts": s, "dur": e - s} for c, n, s, e in main]
    events += [
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 9, "ts": s, "dur": e - s}
        for s, e in [(5_000, 15_000), (20_200, 90_000)]
    ]
    run.trace(0).write_text(json.dumps({"host_name": "a", "traceEvents": events}))
    profile_windows.write(run.profile_window(0), profile_windows.Window(0, 1, 1, 2, 7, "a", trace=run.trace(0).name))
    traces, _ = analysis.load(run, 1)
    row = analysis.breakdown(traces[0])
    assert row == pytest.approx(
        {"rank": 0, "step": 0.1, "compute": 0.0303, "collective": 0.0697, "input": 0.0, "idle": 0.0}
    )


def test_ranks_on_other_hosts_are_aligned_on_their_collectives_ends(tmp_path: Path):
    """A rank on another host whose clock is 5 ms ahead is moved back by 5 ms: its blocking collective ends where
    the first rank's does."""
    run = RunDir(tmp_path)
    for rank, (host, skew) in enumerate([("a", 0.0), ("b", 5000.0)]):
        events = [
            {"ph": "X", "cat": "user_annotation", "name": "air_magic step 2", "tid": 7, "ts": skew, "dur": 100},
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "air_magic: all_reduce #3",
                "tid": 7,
                "ts": skew + 50,
                "dur": 40,
            },
        ]
        run.trace(rank).write_text(json.dumps({"host_name": host, "traceEvents": events}))
        window = profile_windows.Window(rank, 1, 1, 2, 7, host, trace=run.trace(rank).name)
        profile_windows.write(run.profile_window(rank), window)
    traces, _ = analysis.load(run, 2)
    analysis.align(traces)
    assert [t.offset for t in traces] == [0.0, -5000.0]


def test_spans_unite_and_subtract():
    """The interval arithmetic the split is made of."""
    assert analysis.union([(3, 5), (0, 1), (0.5, 2)]) == [(0, 2), (3, 5)]
    assert analysis.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert analysis.length([(0, 2), (1, 3)]) == 3


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "5"])
def test_profile_takes_a_whole_number_of_steps(bad):
    """profile=0, negative, a bool, a float or text is refused, naming the problem and an example."""
    with pytest.raises(ConfigurationError, match=r"whole number of steps to profile, 1 or more.*profile=5"):
        Settings(profile=bad)
    fn = distributed(2, "CPU")(print)
    with pytest.raises(ConfigurationError, match=r"whole number of steps"):
        fn.with_overrides(profile=bad)


def test_profile_needs_the_watch():
    """Profiling counts the watch's steps: profile with watch=False says to keep the watch."""
    with pytest.raises(ConfigurationError, match=r"watch=False turns the watch off"):
        Settings(profile=5, watch=False)
    assert distributed(2, "CPU")(print).with_overrides(profile=5).settings.spec(print, (), {}, "f").profile == 5


def test_the_record_shows_the_profile(tmp_path: Path):
    """The static record (HTML and text) carries the table, the slowest rank and the merged trace's path."""
    run = RunDir(tmp_path)
    _profiled_rank(run, 0, 0.0, _nothing)
    _profiled_rank(run, 1, 0.05, _nothing)
    spec = JobSpec(target=print, args=(), kwargs={}, name="f", world_size=2, accelerator_type="CPU", timeout=None)
    result = JobResult(spec, tmp_path, [RankResult(0), RankResult(1)], status=JobStatus.FINISHED)
    result.profile = build(run, 2)
    bundle = record_bundle(result, [TailBuffer(), TailBuffer()], run.logs(2), None)
    for text in bundle.values():
        assert "collective ms" in text and "slowest: rank 1 (input" in text and str(run.merged_trace) in text


def test_the_skew_names_the_rank_furthest_behind_not_the_one_last_most_often_by_a_hair(tmp_path: Path):
    """In one step rank 1 starts the bucket all-reduce 10 ms after rank 0, and rank 0 starts the two collectives after
    it 0.5 ms after rank 1: rank 1 is named, last at 1 of 3, 10 ms per step behind, at most 10 ms."""
    run = RunDir(tmp_path)
    starts = {0: [0, 20_500, 30_500], 1: [10_000, 20_000, 30_000]}  # µs from the step's start
    for rank, at in starts.items():
        events = [{"ph": "X", "cat": "user_annotation", "name": "air_magic step 2", "tid": 7, "ts": 0, "dur": 40_000}]
        events += [{"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "tid": 7, "ts": t, "dur": 10} for t in at]
        run.trace(rank).write_text(json.dumps({"host_name": "a", "traceEvents": events}))
        window = profile_windows.Window(rank, 1, 1, 2, 7, "a", trace=run.trace(rank).name)
        profile_windows.write(run.profile_window(rank), window)
    traces, _ = analysis.load(run, 2)
    skew = analysis.skew(traces)
    assert skew is not None and (skew.rank, skew.last, skew.collectives) == (1, 1, 3)
    assert skew.seconds == pytest.approx(0.010) and skew.worst == pytest.approx(0.010)
    assert (
        skew.text()
        == "rank 1 arrives last at 1 of 3 collectives, 10.0 ms per step after the first rank (at most 10.0 ms at one)"
    )
