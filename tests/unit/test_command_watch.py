"""The node's watch of a command run's ranks (cli/command_watch.py) on hand-made rank files: which files are ranks,
what it says and records, and the lines that `--watch` and `-o json` take for alerts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from air_magic.cli.command_watch import WATCH_PREFIX, CommandWatch, NodeAlerts, alert_kind, command_ranks
from air_magic.launch.files import step_times
from air_magic.launch.files.step_times import Collective, RankSteps, Step


def _rank(directory: Path, rank: int, compute: float, collective: float) -> None:
    now = time.time()
    info = {"pid": os.getpid(), "create_time": None, "rank": rank, "local_rank": rank, "node": 0, "stacks_signal": 0}
    (directory / f"rank_{rank}.json").write_text(json.dumps(info))
    steps = tuple(Step(i, compute + collective, 0.0, collective) for i in range(30))
    state = RankSteps(rank, os.getpid(), now, 30, now, 30, recent=steps, collective=Collective("all_reduce", 31, now))
    step_times.write(directory / f"rank_{rank}.steps.json", state)


def test_a_rank_slower_in_its_compute_is_said_once_as_a_line_and_an_alert_with_its_rank(tmp_path):
    """Rank 1 computes 0.2 s a step and rank 0 waits for it: one straggler alert, said and recorded with rank 1; a
    second look says nothing new; the steps files are not taken for ranks' info files."""
    for rank, (compute, collective) in {0: (0.01, 0.2), 1: (0.2, 0.01)}.items():
        _rank(tmp_path, rank, compute, collective)
    said: list[str] = []
    alerts = NodeAlerts(tmp_path / "alerts.jsonl", attempt=0, node=0)
    watch = CommandWatch(tmp_path, alerts, said.append)
    assert sorted(watch.ranks()) == [0, 1] and all("local_rank" in info for info in watch.ranks().values())
    assert watch.look() == said and len(said) == 1
    assert said[0].startswith(f"{WATCH_PREFIX}straggler: rank 1 is a straggler") and "its compute" in said[0]
    assert watch.look() == []
    alerts.close()
    (recorded,) = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert {k: recorded[k] for k in ("attempt", "node", "kind", "rank", "line")} == {
        "attempt": 0,
        "node": 0,
        "kind": "straggler",
        "rank": 1,
        "line": said[0],
    }
    assert alerts.raised == [{k: recorded[k] for k in ("attempt", "node", "kind", "line", "rank")}]
    used = command_ranks({0: tmp_path, 1: tmp_path})  # both "ranks" are this process: alive, sampled
    pid = os.getpid()
    assert [(r["rank"], r["node"], r["pid"], r["running"]) for r in used] == [(0, 0, pid, True), (1, 0, pid, True)]
    assert all(r["peak_memory"] >= r["memory"] > 0 for r in used), used


def test_the_watchs_lines_and_the_fatal_ones_are_alerts_and_nothing_else_is():
    assert alert_kind(f"{WATCH_PREFIX}hang: rank 1 hangs: no progress for 31 s") == "hang"
    assert alert_kind(f"{WATCH_PREFIX}straggler: rank 0 is a straggler: 0.2 s") == "straggler"
    assert alert_kind("Segmentation fault (core dumped)") == "segfault"
    assert alert_kind("rank 1 hangs around the garden") is None
    assert alert_kind(f"{WATCH_PREFIX}no kind here") is None


class _ProcessesNvml:
    """Stands in for nvidia-ml-py: two GPUs; GPU 1 lists this process (3 GiB) and another one, GPU 0 only others."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        entry = type("Process", (), {})
        mine = entry()
        mine.pid, mine.usedGpuMemory = os.getpid(), 3 << 30
        other = entry()
        other.pid, other.usedGpuMemory = 1, 7 << 30
        return [mine, other] if handle == 1 else [other]


def test_the_gpu_a_rank_holds_memory_on_is_in_its_usage_and_in_get(tmp_path, monkeypatch):
    """A command's rank picks its GPU itself: the watch finds it in NVML's list of processes (this process on GPU 1,
    3 GiB; other processes and GPU 0 left out) and writes it to the usage file that `get` reads."""
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", _ProcessesNvml())
    monkeypatch.setattr("air_magic.launch.nvml._state", [])
    _rank(tmp_path, 0, 0.01, 0.01)
    alerts = NodeAlerts(tmp_path / "alerts.jsonl", attempt=0, node=0)
    watch = CommandWatch(tmp_path, alerts, lambda line: None)
    watch.look()
    alerts.close()
    (used,) = command_ranks({0: tmp_path})
    assert used["gpus"] == {"1": 3 << 30}, used


def test_the_watch_hands_its_ranks_step_times_and_usage_to_its_sink_as_mlflow_metrics(tmp_path):
    """Each look past `log_every`, and the stop, hand the sink the function runs' names: each rank's step times
    (rank 1's compute the longer, rank 0's wait in the collective) and its usage; a sink that fails is said once in
    the node's log and not called again."""
    for rank, (compute, collective) in {0: (0.01, 0.2), 1: (0.2, 0.01)}.items():
        _rank(tmp_path, rank, compute, collective)
    sent: list[tuple[dict[str, float], int]] = []
    said: list[str] = []
    alerts = NodeAlerts(tmp_path / "alerts.jsonl", attempt=0, node=0)
    watch = CommandWatch(tmp_path, alerts, said.append, sink=lambda values, step: sent.append((values, step)))
    watch.log_every = 0.0
    watch.look()
    ((values, step),) = sent
    assert values["watch/rank_1/compute"] == 0.2 and values["watch/rank_0/collective_wait"] == 0.2, values
    assert values["watch/rank_1/straggler_lag"] > 0 and step >= 0
    assert values["system/command_rank_0/memory_mib"] > 1 and "system/command_rank_0/cpu_percent" in values, values
    assert "system/command_rank_0/gpu_memory_mib" not in values  # no GPU held (none on this machine's NVML, or no NVML)

    def broken(values, step):
        raise OSError("the tracking server is gone")

    watch.sink = broken
    watch.look()
    watch.stop()
    alerts.close()
    assert [line for line in said if "MLflow" in line] == [
        "air-magic: the watch's metrics are not logged to MLflow: OSError: the tracking server is gone"
    ]
