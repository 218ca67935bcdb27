"""Inside a node's rank: the workload's `command`, run once on this node as the runtime runs it.

A command workload is a call of a rank per GPU (or CPU slot) of each node (cli/jobfile.py), so that the node's units
are leased as one call's; every rank runs `run_node`, and the node's first rank runs `command.sh` with bash in the
code snapshot's directory, with the runtime's variables (`NUM_NODES`, `NODE_RANK`, `LOCAL_WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`, `CODE_SOURCE_PATH`, `HYPERPARAMETERS_PATH`, `MLFLOW_RUN_ID`, `MLFLOW_TRACKING_URI`),
the file's `env_variables` and `secrets`, and without the rank's own `RANK`/`LOCAL_RANK`/`WORLD_SIZE`: the command's
launcher (torchrun, accelerate, Ray) makes the ranks. Its output is the node's log (its first rank's log, and a copy
per attempt); the node's other ranks end at once (the call keeps the node's units leased until it ends). On several
nodes (a Ray cluster, where each rank has a directory of its own) the files travel in the call, and node 0 tells the
others the command's MASTER_PORT through a store at the call's own address, where their watches meet too
(cli/watch_peers.py). Each attempt has `timeout_minutes`: past
it the script's processes are stopped and the attempt ends TIMEDOUT. An attempt after the first gets an MLflow run
of its own in the same experiment. The rank hook (cli/command_rank.py), first on the script's PYTHONPATH, makes the
Python processes that its launcher starts (RANK and LOCAL_RANK set) ranks of the run, with their files in the
attempt's `node_<n>/`. Not for: deciding retries (the runner's max_restarts) or reading the logs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import envvars
from ..envvars import INTERNAL_RUN_DIR
from ..launch.files import debug_channel
from ..watching.fatal_lines import kind_of
from ..watching.listener import hang_after
from .command_rank import TimeIndex
from .command_watch import CommandWatch
from .files import WorkloadDir
from .node_alerts import NodeAlerts
from .node_mlflow import attempt_run, metrics_sink, tag_alerts
from .watch_peers import WatchPeers

#: Seconds between SIGTERM and SIGKILL when an attempt's time is up.
KILL_GRACE = 10.0

#: The rank's launcher variables, which the node's command must not see (its launcher sets its own).
RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class CommandFailed(RuntimeError):
    """A node's `command` exited with a non-zero code: the attempt failed."""


class AttemptTimedOut(RuntimeError):
    """A node's `command` ran past `timeout_minutes`: the attempt timed out."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _address_towards(addr: str) -> str:
    """This node's address on the way to `addr` (node 0): the interface a packet to it would leave from."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((addr, 9))  # a datagram socket's connect sends nothing
            return str(sock.getsockname()[0])
    except OSError:
        return "127.0.0.1"


#: The rank hook's directory (only a sitecustomize.py): first on the command's PYTHONPATH (cli/command_rank.py).
RANK_HOOK_DIR = Path(__file__).resolve().parent / "rank_hook"


def node_env(
    base: dict[str, str], node: dict[str, Any], files: WorkloadDir, cwd: Path, rank_dir: Path | None = None
) -> dict[str, str]:
    """The command's environment: `base` without the rank's variables, plus the runtime's and the file's; the
    cached environment of the missing dependencies (cli/layer.py), if any, first on PATH (its `python`) and on
    PYTHONPATH (for your environment's Pythons: torchrun's and its ranks'); with `rank_dir`, the rank hook first on
    PYTHONPATH, so the ranks its launcher starts keep their files there."""
    env = {k: v for k, v in base.items() if k not in RANK_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.update(
        {
            "NUM_NODES": str(node["num_nodes"]),
            "NODE_RANK": str(node["node_rank"]),
            "LOCAL_WORLD_SIZE": str(node["local_world_size"]),
            "MASTER_ADDR": node["master_addr"],
            "MASTER_PORT": str(node["master_port"]),
            # the names the runtime's older docs also give: its node rank again, node 0 or not, its own address
            "POD_RANK": str(node["node_rank"]),
            "IS_HOST": "1" if int(node["node_rank"]) == 0 else "0",
            "LOCAL_ADDR": _address_towards(node["master_addr"]),
            "MLFLOW_ENABLE_ASYNC_LOGGING": "false",  # a script's last metrics are written before it exits
        }
    )
    if node.get("code_source"):
        env["CODE_SOURCE_PATH"] = str(cwd)
    if files.hyperparameters.exists():
        env["HYPERPARAMETERS_PATH"] = str(files.hyperparameters)
    # `python` in the command is this environment's, as in an activated virtual environment
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(node.get("env_variables") or {})
    env.update(node.get("secrets") or {})
    layer = node.get("layer")
    if layer:  # {"PATH": its bin, "PYTHONPATH": its site-packages}
        for name in ("PATH", "PYTHONPATH"):
            env[name] = os.pathsep.join([layer[name], *filter(None, [env.get(name)])])
    if rank_dir is not None and env.get(envvars.RANK_HOOK) != "0":
        env[envvars.RANK_DIR] = str(rank_dir)
        env["PYTHONPATH"] = os.pathsep.join([str(RANK_HOOK_DIR), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _materialize(files: WorkloadDir, shipped: dict[str, Any]) -> None:
    """On a node whose rank has a directory of its own (another machine's), the files `run` wrote: command.sh,
    the hyperparameters and the code snapshot, from the call's payload."""
    import io
    import tarfile

    files.command.write_text(shipped["command"])
    if shipped.get("hyperparameters") is not None:
        files.hyperparameters.write_text(shipped["hyperparameters"])
    if shipped.get("code_source") is not None:
        files.code_source.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(shipped["code_source"])) as tar:
            tar.extractall(files.code_source, filter="data")


def _command_port(num_nodes: int, node_rank: int) -> tuple[int, Any]:
    """The MASTER_PORT every node's command gets: a free port of this machine on one node; on several, node 0's,
    told to the others through a store at the call's own MASTER_ADDR:MASTER_PORT (kept open while it runs)."""
    if num_nodes == 1:
        return _free_port(), None
    from datetime import timedelta

    from torch.distributed import TCPStore

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = TCPStore(addr, port, is_master=node_rank == 0, wait_for_workers=False, timeout=timedelta(minutes=10))
    if node_rank == 0:
        store.set("air_magic/command_port", str(_free_port()))
    return int(store.get("air_magic/command_port")), store


def run_node(node: dict[str, Any]) -> int:
    """Run the workload's `command.sh` once on this node, from the node's first rank (the others hold their
    units until it ends); 0, or raise CommandFailed / AttemptTimedOut."""
    sys.stdout.flush()
    run_dir = Path(os.environ[INTERNAL_RUN_DIR])
    files = WorkloadDir(run_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    node_rank = int(os.environ.get("GROUP_RANK", "0"))
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0  # the call keeps the node's units leased until it ends; the node's first rank runs the command
    num_nodes = int(os.environ.get("WORLD_SIZE", "1")) // per_node
    if not files.command.exists() and node.get("files"):
        _materialize(files, node["files"])
    port, store = _command_port(num_nodes, node_rank)  # the rank's own MASTER_PORT is air_magic's, not the command's
    node = {
        **node,
        "node_rank": node_rank,
        "num_nodes": num_nodes,
        "master_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "master_port": port,
    }
    cwd = files.code_source / node["code_source"] if node.get("code_source") else run_dir
    rank_dir = files.rank_dir(attempt, node["node_rank"])
    rank_dir.mkdir(parents=True, exist_ok=True)
    env = node_env(dict(os.environ), node, files, cwd, rank_dir)
    mlflow_run = attempt_run(env, node["run_name"], attempt)
    if mlflow_run is not None:
        env["MLFLOW_RUN_ID"] = mlflow_run[1]
    log_path = files.node_log(attempt, node["node_rank"])
    hang = hang_after(env)  # a bad AIR_MAGIC_HANG_AFTER in env_variables is said before anything starts
    started = time.monotonic()
    proc = subprocess.Popen(
        ["bash", str(files.command)],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        process_group=0,  # its own group: a timeout stops the whole script, torchrun's children with it
    )
    assert proc.stdout is not None
    stream = proc.stdout

    out = getattr(sys.stdout, "buffer", None)
    alerts = NodeAlerts(files.alerts, attempt, node["node_rank"])
    written = threading.Lock()  # the command's lines and the watch's, each whole

    def write(raw: bytes) -> None:
        with written:
            if out is not None:
                out.write(raw)
            else:
                sys.stdout.write(raw.decode(errors="replace"))
            sys.stdout.flush()
            index.note(len(raw))
            log.write(raw)
            log.flush()

    def copy() -> None:
        for raw in iter(stream.readline, b""):
            write(raw)
            line = raw.decode(errors="replace").rstrip("\n")
            kind = kind_of(line)
            if kind is not None:
                alerts.add(kind, line)

    log = open(log_path, "ab")  # noqa: SIM115 - closed when the command has ended
    index = TimeIndex(log_path, log.tell())  # when each line came, for `logs --minutes`

    def watch_line(line: str) -> None:
        write((line + "\n").encode())

    peers = WatchPeers(store, node["node_rank"], num_nodes, attempt) if store is not None else None
    watch = CommandWatch(rank_dir, alerts, watch_line, hang, sink=metrics_sink(env), peers=peers).start()
    reader = threading.Thread(target=copy, name="air_magic-node-log", daemon=True)
    reader.start()
    limit = node.get("timeout_minutes")
    timed_out = False
    try:
        code = proc.wait(timeout=limit * 60 if limit else None)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=KILL_GRACE)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    reader.join(5.0)
    watch.stop()
    debug_channel.clean(rank_dir, max(watch.ranks(), default=-1) + 1)  # a prompt no one answered leaves no FIFO
    if not reader.is_alive():  # else a process the script left holds its output: the reader keeps copying
        log.close()
        index.close()
    alerts.close()
    del store  # node 0's store of the port lives as long as its command
    seconds = time.monotonic() - started
    end = {"exit_code": code, "timed_out": timed_out, "seconds": round(seconds, 3)}
    if mlflow_run is not None:
        end["mlflow_run_id"] = mlflow_run[1]
        status = "FINISHED" if code == 0 and not timed_out else "FAILED"
        try:
            mlflow_run[0].set_terminated(mlflow_run[1], status)
        except Exception:  # noqa: BLE001, S110 - the run's end is best effort; the attempt's outcome stands
            pass
    if alerts.raised:
        tag_alerts(env, alerts.raised)
    files.node_end(attempt, node["node_rank"]).write_text(json.dumps(end))

    def say(text: str) -> None:  # in the rank's log and the attempt's, as the launch script's own lines
        print(text, flush=True)
        with open(log_path, "a") as log:
            log.write(text + "\n")

    if timed_out:
        message = f"node {node['node_rank']}: attempt {attempt} timed out after {limit} minute(s)"
        say(f"air-magic: {message}")
        raise AttemptTimedOut(message)
    if code != 0:
        say(f"ERROR: Script failed with exit code {code} after {seconds:.0f}s")
        raise CommandFailed(f"node {node['node_rank']}: the command exited with code {code}")
    return 0
