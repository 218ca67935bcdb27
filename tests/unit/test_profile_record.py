"""Every profile of a call is in its record (call.json) and in `air-magic get`: what `profile=N` found and what each
profile of the running call found, in their order."""

from __future__ import annotations

import json
import time

from air_magic.calls import record as call_record
from air_magic.cli.main import main as cli_main
from air_magic.job import JobResult, JobSpec, JobStatus, RankResult
from air_magic.launch.files.rundir import RunDir
from air_magic.launch.rank.profiler import INPUT, Window, collective_mark
from air_magic.profiling.listener import build


def _profiled_rank(run: RunDir, rank: int, input_wait: float, number: int = 0) -> None:
    """A rank's step recorder over 6 step boundaries (steps 2-4 counted), waiting `input_wait` s for input a step."""
    window = Window(3, rank, run.trace(rank, number), run.profile_window(rank, number))
    for index in range(6):
        window.boundary(index, None if index == 0 else (0.01, input_wait, 0.0))
        mark = window.mark(INPUT)
        time.sleep(input_wait)
        Window.leave(mark)
        mark = window.mark(collective_mark("all_reduce", index))
        time.sleep(0.001)
        Window.leave(mark)
    window.close()


def test_the_record_keeps_every_profile_of_the_call_and_get_shows_them(tmp_path, monkeypatch, capsys):
    """profile=N's profile (rank 1 slow in its input) and a later one of the running call (rank 0 slow): the final
    record lists both, first profile=N's, each with its ranks, slowest rank and merged trace; `get` prints them and
    its JSON holds them."""
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path))
    path = tmp_path / "20260101-000000-train-abcdefgh"
    path.mkdir()
    run = RunDir(path)
    _profiled_rank(run, 0, 0.0, number=2)
    _profiled_rank(run, 1, 0.0, number=2)
    _profiled_rank(run, 0, 0.0)
    _profiled_rank(run, 1, 0.04)
    later = build(run, 2, 2)
    spec = JobSpec(target=print, args=(), kwargs={}, name="train", world_size=2, accelerator_type="CPU", timeout=None)
    result = JobResult(spec, path, [RankResult(0), RankResult(1)], status=JobStatus.FINISHED)
    result.profile = build(run, 2)
    assert later is not None and result.profile is not None
    record = call_record.CallRecord(path)
    record.begin(spec, call_record.RUNNING)
    record.end(result, None)
    kept = call_record.read(path)["profiles"]  # type: ignore[index]
    assert [p["number"] for p in kept] == [0, 2]
    assert kept[0]["slowest"] == [1, "input"] and kept[0]["trace"] == str(run.merged_trace)
    assert kept[1]["trace"] == str(run.merged(2)) and [r["rank"] for r in kept[1]["ranks"]] == [0, 1]
    assert kept[0]["summary"] == result.profile.summary()
    assert cli_main(["get", path.name]) == 0
    assert f"profile: {result.profile.summary()}; merged trace: {run.merged_trace}" in capsys.readouterr().out
    assert cli_main(["get", path.name, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["profiles"] == kept
