"""The watch of a command run's ranks, on each node: stragglers and hangs named from the ranks' step files.

A rank that the command's own launcher started (cli/command_rank.py) records its steps once it has imported torch,
as a function's rank does (launch/rank/steps.py: DataLoader batches or `air_magic.step()`, time in collectives), into
`rank_<R>.steps.json` in its node's directory. The node's first rank (cli/node.py) reads those files every second
while the command runs and judges them with the watch's own rules (watching/detector.py, docs/watching.md). What it
names is an alert of the attempt, as a fatal line is (`NodeAlerts`): a line in the node's log (`air-magic: watch:
<kind>: <message>`, which `--watch` and `-o json` turn into ALERT lines: `alert_kind`), a line of `alerts.jsonl`
(`get`) and, at the attempt's end, a tag of its MLflow run. A hung rank is asked for its stacks (into its
`rank_<R>.stacks`, what `air-magic stacks` prints). On several nodes node 0 judges every node's ranks, which the
others put in the store the nodes share (cli/watch_peers.py); alone, a node judges its own. Each look also samples
what each live rank uses (its process and its children: CPU %, resident memory, the peak, and the memory they hold on
each GPU, from NVML's list of processes: launch/nvml.py) into `rank_<R>.usage.json`, which `get` shows
(`command_ranks`). Every `LOG_EVERY` seconds, and once at the end, what it read goes to `sink` as MLflow metrics:
`watch/rank_N/input_wait`, `compute`, `collective_wait`, `straggler_lag` (named as a function run's; node 0's only, on
several nodes) and `system/command_rank_N/cpu_percent`, `memory_mib`, `gpu_memory_mib` (the node logs them to the
attempt's run; `system/rank_N/` is the call's own sampler's, of its units). Not for: the ranks' side, or a function
run's watch (watching/listener.py).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..launch import nvml
from ..launch.files import step_times
from ..launch.files.command_logs import WATCH_PREFIX
from ..launch.files.rundir import write_private
from ..launch.tree_usage import TreeUsage
from ..watching.detector import HANG_AFTER, Detector
from ..watching.listener import LOG_EVERY
from ..watching.listener import metrics as step_metrics
from .command_rank import STACKS_SIGNAL, rank_file
from .node_alerts import NodeAlerts
from .watch_peers import RemoteRank, WatchPeers

#: Seconds between two readings of the ranks' files.
PERIOD = 1.0
#: Seconds within which a rank of another machine was last sampled by its node, if it still runs.
FRESH = 5.0


def here(info: dict[str, Any]) -> bool:
    """The rank ran on this machine (a rank of another node of a cluster came back with its node's files)."""
    host = info.get("host")
    return host is None or host == socket.gethostname()


def alive(info: dict[str, Any]) -> bool:
    """The rank's process still runs: its pid is the same process (create time) and not a zombie; False for a rank
    of another machine (its pid is not this machine's)."""
    import psutil

    if not here(info):
        return False
    try:
        proc = psutil.Process(int(info["pid"]))
        if info.get("create_time") is not None and abs(proc.create_time() - float(info["create_time"])) > 1.0:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


class CommandWatch:
    """Every `period` seconds while the command runs: read the node's ranks' step files, name what is new, and say
    it (`say`: a line into the node's log) and record it (`alerts`). `stop()` ends it."""

    def __init__(
        self,
        rank_dir: Path,
        alerts: NodeAlerts,
        say: Callable[[str], None],
        hang_after: float = HANG_AFTER,
        period: float = PERIOD,
        sink: Callable[[dict[str, float], int], None] | None = None,
        log_every: float = LOG_EVERY,
        peers: WatchPeers | None = None,
    ) -> None:
        self.rank_dir, self.alerts, self.say, self.period = rank_dir, alerts, say, period
        self.peers = peers
        self.sink, self.log_every = sink, log_every
        self.started = self.last_sent = time.monotonic()
        self.used: dict[int, dict[str, Any]] = {}  # each rank's newest usage
        self.sink_error: str | None = None
        self.detector = Detector(0, hang_after)
        self.trees = TreeUsage()
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="air_magic-command-watch", daemon=True)

    def start(self) -> CommandWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the watch, once the command has ended: a last look judges the steps read last (stragglers only), and
        what it read goes to the sink once more."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(5.0)
        try:
            self.look(final=True)
        except Exception:  # noqa: BLE001, S110 - a file half written at the end: what was judged before stands
            pass
        self.send()

    def send(self) -> None:
        """Hand the ranks' recent step times and usage to the sink, as MLflow metrics (a failing sink is said once
        in the node's log, and not called again)."""
        self.last_sent = time.monotonic()
        if self.sink is None or self.sink_error is not None:
            return
        lags = {rank: lag.seconds for rank, lag in self.detector.lags.items()}
        values = step_metrics(self.detector.summary(), lags) if self.judging else {}  # node 0's, on several nodes
        for rank, used in sorted(self.used.items()):
            key = f"system/command_rank_{rank}/"  # system/rank_N/ is the call's own: its units, a node each
            values[key + "cpu_percent"] = used["cpu_percent"]
            values[key + "memory_mib"] = round(used["memory"] / 2**20, 1)
            if used["gpus"]:
                values[key + "gpu_memory_mib"] = round(sum(used["gpus"].values()) / 2**20, 1)
        if not values:
            return
        try:
            self.sink(values, int(self.last_sent - self.started))
        except Exception as exc:  # noqa: BLE001 - the watch goes on without its metrics
            self.sink_error = f"{type(exc).__name__}: {exc}"
            self.say(f"air-magic: the watch's metrics are not logged to MLflow: {self.sink_error}")

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.look()
            except Exception:  # noqa: BLE001, S112 - a file read half-way now is read whole a second later
                continue

    def ranks(self) -> dict[int, dict[str, Any]]:
        """The ranks this node's launcher started, by global rank: what each `rank_<R>.json` says."""
        found = {}
        for path in self.rank_dir.glob("rank_*.json"):
            if not path.name[len("rank_") : -len(".json")].isdigit():
                continue  # rank_<R>.steps.json
            try:
                info = json.loads(path.read_text())
                found[int(info["rank"])] = info
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found

    @property
    def judging(self) -> bool:
        """This node names stragglers and hangs: alone, node 0 of several, or a node that lost node 0's store."""
        return self.peers is None or self.peers.judge or self.peers.broken

    def look(self, final: bool = False) -> list[str]:
        """Read each rank's step file once, judge, and say what is new; the lines said. `final`: the ranks have
        ended, every rank that left steps is judged, for stragglers only."""
        now, wall = time.monotonic(), time.time()
        ranks = self.ranks()
        steps = {rank: step_times.read_bytes(rank_file(self.rank_dir, rank, "steps.json")) for rank in ranks}
        for rank, data in steps.items():
            state = step_times.decode(data) if data else None
            if state is not None:
                self.detector.update(rank, state, now)
        running = set(ranks) if final else {rank for rank, info in ranks.items() if alive(info)}
        for rank in running if not final else ():
            found = self.trees.sample(int(ranks[rank]["pid"]))
            if found is not None:
                self._note_usage(rank, *found, nvml.gpu_memory_of(self.trees.last_tree))
        remote = self._meet(steps, running, ranks, now)
        judged = self.detector.final(wall) if final else self.detector.check(now, wall, running)
        said = []
        for alert in judged if self.judging else []:
            message = alert.message
            if alert.kind == "hang":
                if alert.rank in ranks:
                    message += self._ask_stacks(ranks[alert.rank])
                elif alert.rank in remote:
                    message += self._ask_remote(alert.rank, remote[alert.rank].node)
            line = f"{WATCH_PREFIX}{alert.kind}: {message}"
            self.alerts.add(alert.kind, line, alert.rank)
            self.say(line)
            said.append(line)
        if time.monotonic() - self.last_sent >= self.log_every:
            self.send()
        return said

    def _meet(
        self, steps: dict[int, bytes | None], running: set[int], ranks: dict[int, dict[str, Any]], now: float
    ) -> dict[int, RemoteRank]:
        """On several nodes: node 0 takes the other nodes' ranks into its judgement (and `running`), the others put
        theirs in the store and answer node 0's requests for stacks; the other nodes' ranks."""
        if self.peers is None:
            return {}
        if not self.peers.judge:
            self.peers.publish(steps, running)
            for rank in self.peers.stacks_asked(set(ranks)):
                self._ask_stacks(ranks[rank])
            return {}
        remote = self.peers.others()
        for rank, there in remote.items():
            if there.state is not None:
                self.detector.update(rank, there.state, now)
            if there.running:
                running.add(rank)
        return remote

    def _ask_remote(self, rank: int, node: int) -> str:
        """Ask another node's hung rank for its stacks (through the store); where they will be."""
        assert self.peers is not None
        self.peers.ask_stacks(rank)
        attempt = self.rank_dir.parent
        where = f"{attempt.parent.name}/{attempt.name}/node_{node}/{rank_file(Path(), rank, 'stacks')}"
        return f"; its threads' stacks are asked of node {node}, into {where} of the run's directory"

    def _note_usage(self, rank: int, cpu: float, memory: int, gpus: dict[int, int]) -> None:
        self.peaks[rank] = max(self.peaks.get(rank, 0), memory)
        usage = {
            "cpu_percent": round(cpu, 1),
            "memory": memory,
            "peak_memory": self.peaks[rank],
            "gpus": {str(index): held for index, held in sorted(gpus.items())},
            "time": time.time(),
        }
        self.used[rank] = usage
        path = rank_file(self.rank_dir, rank, "usage.json")
        tmp = path.with_name(path.name + ".tmp")
        write_private(tmp, json.dumps(usage).encode(), exclusive=False)  # 0600, as every file of a run
        os.replace(tmp, path)

    def _ask_stacks(self, info: dict[str, Any]) -> str:
        """Ask a hung rank for its threads' stacks; how to read them."""
        if STACKS_SIGNAL is None or info.get("stacks_signal") != STACKS_SIGNAL:
            return ""
        try:
            os.kill(int(info["pid"]), STACKS_SIGNAL)
        except (OSError, KeyError, TypeError, ValueError):
            return ""
        return f"; its threads' stacks are in {rank_file(self.rank_dir, int(info['rank']), 'stacks')}"


def command_ranks(directories: dict[int, Path]) -> list[dict[str, Any]]:
    """What `get` says of each rank a command's launcher started (`WorkloadDir.command_ranks`): its node, pid, whether
    it still runs, and what it used when last sampled (`cpu_percent`, `memory`, and `gpus`: the GPU memory its processes
    held, by GPU index) and at most (`peak_memory`)."""
    found = []
    for rank, directory in sorted(directories.items()):
        try:
            info = json.loads(rank_file(directory, rank, "json").read_text())
        except (OSError, ValueError):
            info = {}
        try:
            usage = json.loads(rank_file(directory, rank, "usage.json").read_text())
        except (OSError, ValueError):
            usage = {}
        if here(info):
            running = bool(info) and alive(info)
        else:  # its node samples it every second, and its usage comes back as often
            running = time.time() - float(usage.get("time") or 0) < FRESH
        found.append(
            {
                "rank": rank,
                "node": info.get("node"),
                "pid": info.get("pid"),
                "running": running,
                **{key: usage.get(key) for key in ("cpu_percent", "memory", "peak_memory")},
                "gpus": usage.get("gpus") or {},
            }
        )
    return found
