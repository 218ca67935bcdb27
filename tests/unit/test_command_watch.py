"""The node's watch of a command run's ranks (cli/command_watch.py) on hand-made rank files: which files are ranks,
what it says and records, and the lines that `--watch` and `-o json` take for alerts."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from air_magic.cli.command_rank import STACKS_SIGNAL
from air_magic.cli.command_watch import CommandWatch, command_ranks
from air_magic.cli.node_alerts import NodeAlerts, alert_kind
from air_magic.launch.files import step_times
from air_magic.launch.files.command_logs import WATCH_PREFIX
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
    assert (tmp_path / "rank_0.usage.json").stat().st_mode & 0o777 == 0o600  # private, as every file of a run


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


def _node_dir(root: Path, node: int) -> Path:
    directory = root / "attempts" / "attempt_0" / f"node_{node}"
    directory.mkdir(parents=True)
    return directory


def test_on_two_nodes_node_0_judges_the_other_node_s_rank_and_has_it_asked_for_its_stacks(tmp_path, monkeypatch):
    """One rank on each node (each node alone sees no straggler): node 1 puts its rank's steps in the nodes' store,
    node 0 names rank 1 the straggler; then rank 1 stops while rank 0 waits in an all-reduce it never reached: node
    0 names the hang, asks node 1 for rank 1's stacks through the store, node 1 answers once; node 1 says nothing
    itself and logs no watch metrics, node 0 logs both ranks'."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from air_magic.cli.watch_peers import WatchPeers

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    dirs = [_node_dir(tmp_path, node) for node in (0, 1)]
    _rank(dirs[0], 0, 0.01, 0.2)
    _rank(dirs[1], 1, 0.2, 0.01)
    said: list[list[str]] = [[], []]
    sent: list[list[dict[str, float]]] = [[], []]
    watches = []
    for node, node_store in ((0, store), (1, client)):
        peers = WatchPeers(node_store, node, num_nodes=2, attempt=0)
        alerts = NodeAlerts(tmp_path / f"alerts-{node}.jsonl", attempt=0, node=node)
        watch = CommandWatch(dirs[node], alerts, said[node].append, hang_after=1.0, peers=peers)
        watch.sink, watch.log_every = (lambda values, step, node=node: sent[node].append(values)), 0.0
        watches.append(watch)

    watches[1].look()
    watches[0].look()
    assert len(said[0]) == 1 and said[0][0].startswith(f"{WATCH_PREFIX}straggler: rank 1 is a straggler"), said
    assert "watch/rank_1/compute" in sent[0][-1] and "watch/rank_0/compute" in sent[0][-1]
    assert not any(key.startswith("watch/") for values in sent[1] for key in values)

    now = time.time()
    stalled = RankSteps(
        1, os.getpid(), now, 30, now - 5, 30, recent=step_times.read(dirs[1] / "rank_1.steps.json").recent
    )
    step_times.write(dirs[1] / "rank_1.steps.json", stalled)
    _rank(dirs[0], 0, 0.01, 0.2)  # rank 0 waits in all_reduce #31, which rank 1 (30 calls) never reached
    watches[1].look()
    (hang,) = watches[0].look()
    assert hang.startswith(f"{WATCH_PREFIX}hang: rank 1 hangs") and "asked of node 1" in hang, hang
    assert "attempts/attempt_0/node_1/rank_1.stacks" in hang
    info = json.loads((dirs[1] / "rank_1.json").read_text())
    (dirs[1] / "rank_1.json").write_text(json.dumps({**info, "stacks_signal": STACKS_SIGNAL}))
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    watches[1].look()
    watches[1].look()
    assert signalled == [(os.getpid(), STACKS_SIGNAL)]  # node 1 sent rank 1 the stacks signal, once
    assert said[1] == []
    for watch in watches:
        watch.alerts.close()


def test_a_rank_of_another_machine_is_running_while_its_node_samples_it_and_is_never_signalled_here(tmp_path):
    """A rank whose files came back from another machine's node: its pid is not this machine's (never looked up
    or signalled here); `get` calls it running while its node's samples keep coming."""
    from air_magic.cli.command_watch import FRESH, alive

    info = {"pid": os.getpid(), "create_time": None, "rank": 3, "node": 1, "host": "another-machine"}
    (tmp_path / "rank_3.json").write_text(json.dumps(info))
    assert not alive(info) and alive({**info, "host": socket.gethostname()})
    usage = {"cpu_percent": 100.0, "memory": 1 << 30, "peak_memory": 1 << 30, "gpus": {}, "time": time.time()}
    (tmp_path / "rank_3.usage.json").write_text(json.dumps(usage))
    assert command_ranks({3: tmp_path})[0]["running"]
    (tmp_path / "rank_3.usage.json").write_text(json.dumps({**usage, "time": time.time() - FRESH - 1}))
    assert not command_ranks({3: tmp_path})[0]["running"]


def test_a_command_runs_alerts_are_its_handles_alerts_each_under_its_rank(tmp_path):
    """`air_magic.attach(ID).alerts` of a command run (and its panel's badges) are what its nodes raised: the watch's
    under the rank it named, with its cause; a node's fatal line under the node's first rank."""
    from air_magic.calls.attached import command_alerts

    (tmp_path / "workload.json").write_text(json.dumps({"kind": "command", "per_node": 2}))
    node0, node1 = NodeAlerts(tmp_path / "alerts.jsonl", 0, 0), NodeAlerts(tmp_path / "alerts.jsonl", 0, 1)
    node0.add("straggler", f"{WATCH_PREFIX}straggler: rank 1 is a straggler: 0.15 s per step, slower in its compute", 1)
    node1.add("oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    node0.add("hang", f"{WATCH_PREFIX}hang: rank 3 hangs: no progress for 31 s", 3)
    node0.close()
    node1.close()
    found = [(a.kind, a.rank, a.cause, a.message) for a in command_alerts(tmp_path)]
    assert found == [
        ("straggler", 1, "compute", "rank 1 is a straggler: 0.15 s per step, slower in its compute"),
        ("oom", 2, "output", "node 1: oom: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("hang", 3, "no progress", "rank 3 hangs: no progress for 31 s"),
    ]


def test_a_straggler_seen_only_in_the_last_steps_read_is_named_when_the_watch_ends(tmp_path):
    """The ranks ended before a look judged them (a run shorter than the readings' lag, on a busy machine): no look
    names anything while no rank runs, and the watch's end judges the steps read last, stragglers only (a rank's
    last state inside a collective is no hang once every rank has stopped)."""
    for rank, (compute, collective) in {0: (0.01, 0.2), 1: (0.2, 0.01)}.items():
        _rank(tmp_path, rank, compute, collective)
        info = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        (tmp_path / f"rank_{rank}.json").write_text(json.dumps({**info, "pid": 2**22 + 4321}))  # no such process
    said: list[str] = []
    alerts = NodeAlerts(tmp_path / "alerts.jsonl", attempt=0, node=0)
    watch = CommandWatch(tmp_path, alerts, said.append, hang_after=0.0)
    assert watch.look() == []
    watch.stop()
    alerts.close()
    assert len(said) == 1 and said[0].startswith(f"{WATCH_PREFIX}straggler: rank 1 is a straggler"), said
