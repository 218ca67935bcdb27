"""Where a command run keeps its ranks' logs in the call's run directory, and which attempt is the newest.

A command run (`air-magic run` of a workload whose `command` starts the ranks itself, as torchrun does) keeps,
per attempt A, a directory per node N, `attempts/attempt_A/node_N/`, in which each rank R that the command's
launcher started writes `rank_R.log` (R is the rank's global RANK; cli/command_rank.py writes them). The run's
`workload.json` says `"kind": "command"`. The call's own logs, `rank-U.log` per unit, hold each node's whole
output (the launcher's lines and every local rank's, interleaved). Read by the panel of an attached command run
(display/follow.py), which shows rank R's own log in tab R; the workload's other files are cli/files.py's. What a
node of another machine writes there comes back as it is written (node_mirror.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ATTEMPTS = "attempts"
INFO = "workload.json"
#: How the line of a watch alert starts in a node's log: `air-magic: watch: straggler: rank 1 is a straggler: ...`.
WATCH_PREFIX = "air-magic: watch: "
#: The alerts every node of the run raised, a line each (cli/node_alerts.py).
ALERTS = "alerts.jsonl"
#: What a node writes in the run directory while its command runs, which a node of another machine sends back
#: (node_mirror.py): every attempt's directory, and its alerts.
TRAVELLING = (ATTEMPTS, ALERTS)


def attempt_dir(run_dir: Path, attempt: int) -> Path:
    return Path(run_dir) / ATTEMPTS / f"attempt_{attempt}"


def node_dir(run_dir: Path, attempt: int, node: int) -> Path:
    """The files of the ranks that node `node`'s command started in attempt `attempt`."""
    return attempt_dir(run_dir, attempt) / f"node_{node}"


def attempts(run_dir: Path) -> list[int]:
    """The attempts that started, in order (0 the first)."""
    found = [p.name.removeprefix("attempt_") for p in (Path(run_dir) / ATTEMPTS).glob("attempt_*")]
    return sorted(int(n) for n in found if n.isdigit())


def info(run_dir: Path) -> dict[str, Any]:
    """What `run` wrote of the workload (`workload.json`: its kind, ranks per node, ...); {} for another call."""
    try:
        value = json.loads((Path(run_dir) / INFO).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def is_command_run(run_dir: Path) -> bool:
    """The run directory is a command run's (its `workload.json` says so)."""
    return info(run_dir).get("kind") == "command"


def rank_logs(run_dir: Path, attempt: int) -> dict[int, Path]:
    """Global RANK -> its log, for the ranks the command's launcher started in attempt `attempt` (on every node)."""
    found = {}
    for log in attempt_dir(run_dir, attempt).glob("node_*/rank_*.log"):
        number = log.name.removeprefix("rank_").removesuffix(".log")
        if number.isdigit():
            found[int(number)] = log
    return dict(sorted(found.items()))


def alerts(run_dir: Path) -> list[dict[str, Any]]:
    """The alerts every node of the run raised so far, oldest first: `{"attempt", "node", "kind", "line", "time"}`,
    with `rank` for a rank's (a line of `alerts.jsonl` each; one half written is left for the next read)."""
    try:
        lines = (Path(run_dir) / ALERTS).read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            found.append(entry)
    return found
