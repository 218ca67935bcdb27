"""The workload file of `air-magic run -f job.yaml`, read as the runtime reads it, and the call it becomes.

`load(path, overrides)` reads the YAML file, applies `--override KEY=VALUE` (each change said on stderr), checks
every field (cli/schema.py), finds the code snapshot's root (cli/snapshot.py), the nodes (cli/topology.py), the
secrets (cli/secrets.py) and what the environment lacks of `environment.dependencies` (cli/dependencies.py: it is
installed at `run` into a cached environment layered over yours, cli/layer.py), and gives a `Job`. A `command`
workload is a call of a rank per GPU (or CPU slot) of each node whose first rank on the node runs the command once
(cli/node.py); `function: module:name` (air_magic's) is the function itself on every rank, as `@distributed` runs
it. `Job.prepare(run_dir)` writes what the nodes read (cli/files.py) before the call starts. Not for: starting or
following the call (cli/main.py, calls/detached.py).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..decorator import Settings
from ..errors import AirMagicError
from ..job import JobSpec
from . import dependencies, schema, snapshot, topology
from .files import WorkloadDir
from .layer import Layer
from .schema import JobFileError
from .yamlfile import apply_override, read

__all__ = ["Job", "JobFileError", "apply_override", "load"]

#: max_retries when the file leaves it out, as the runtime defaults it.
DEFAULT_MAX_RETRIES = 3


def _text(value: Any) -> str:
    """An env_variables value as the variable's text: YAML's `true` is "true", `null` is ""."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def join_ray(num_nodes: int, one_node: str = "--override compute.num_nodes=1") -> None:
    """Join the Ray cluster of $RAY_ADDRESS, else the one started on this machine with `ray start` ("auto")."""
    from ..launch import ray_init

    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray_init(address, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - any failure to join is said the same way
        raise JobFileError(
            f"compute asks for {num_nodes} nodes, which run on a Ray cluster, and joining {address!r} failed "
            f"({type(exc).__name__}: {exc}); start one with `ray start --head` or set RAY_ADDRESS, or run one "
            f"node with {one_node}"
        ) from None


@dataclass
class Job:
    """A checked workload file."""

    path: Path
    data: dict[str, Any]
    name: str
    code: snapshot.Snapshot | None
    nodes: topology.Topology | None  # a command workload's; None for a function
    secrets: dict[str, str] = field(default_factory=dict)
    lacking: list[str] = field(default_factory=list)
    layer: Layer | None = None  # where what it lacks is installed at `run`
    notices: list[str] = field(default_factory=list)

    @property
    def experiment_name(self) -> str | None:
        return self.data.get("experiment_name")

    @property
    def max_retries(self) -> int:
        value = self.data.get("max_retries")
        return DEFAULT_MAX_RETRIES if value is None else int(value)

    @property
    def idempotency_token(self) -> str | None:
        return self.data.get("idempotency_token")

    @property
    def num_nodes(self) -> int:
        return self.nodes.nodes if self.nodes is not None else int((self.data.get("compute") or {}).get("num_nodes", 1))

    @property
    def root(self) -> Path:
        return self.code.root if self.code is not None else self.path.parent.resolve()

    def resolve_secrets(self) -> None:
        """Read every secret from the local store (cli/secrets.py); JobFileError naming the missing ones."""
        from . import secrets

        self.secrets = secrets.resolve(self.data.get("secrets") or {})

    def refusal(self) -> str | None:
        """Why this machine cannot run the file as written (with the override that fits), or None."""
        from ..accelerators import detect

        if self.nodes is not None:
            why = self.nodes.refusal(detect())
            if why:
                return why
        return dependencies.refusal(self.lacking, self.num_nodes)

    def install(self, say: Any) -> None:
        """Refuse what this machine cannot run, then install what the environment lacks into the cached layer
        (made once; `say` is told which), before anything starts; JobFileError if it cannot be installed."""
        why = self.refusal()
        if why:
            raise JobFileError(why)
        if self.layer is not None:
            self.layer.ensure(say)

    def node(self) -> dict[str, Any]:
        """What each node's rank gets (cli/node.py's run_node)."""
        assert self.nodes is not None
        minutes = self.data.get("timeout_minutes")
        shipped = None
        if self.nodes.nodes > 1:  # each node's ranks have a directory of their own there: the files travel
            shipped = {
                "command": self.data["command"],
                "hyperparameters": self._hyperparameters(),
                "code_source": self.code.archive() if self.code is not None else None,
            }
        return {
            "files": shipped,
            "code_source": self.code.name if self.code is not None else None,
            "local_world_size": self.nodes.per_node,
            "timeout_minutes": minutes,
            "env_variables": {k: _text(v) for k, v in (self.data.get("env_variables") or {}).items()},
            "secrets": self.secrets,
            "run_name": self.name,
            "layer": None if self.layer is None else self.layer.env({}),
        }

    def target(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """What every rank runs: `run_node(node)` once per node, or the function with its args and kwargs."""
        if self.nodes is not None:
            from .node import run_node

            return run_node, (self.node(),), {}
        module_name, _, attr = self.data["function"].partition(":")
        if str(self.root) not in sys.path:
            sys.path.insert(0, str(self.root))
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the file's to fix
            raise JobFileError(
                f"function: cannot import {module_name!r} from {self.root}: {type(exc).__name__}: {exc}"
            ) from None
        func = getattr(module, attr, None)
        if not callable(func):
            raise JobFileError(f"function: {module_name!r} has no function {attr!r}")
        return func, tuple(self.data.get("args") or ()), dict(self.data.get("kwargs") or {})

    def settings(self) -> Settings:
        compute = self.data.get("compute") or {}
        minutes = self.data.get("timeout_minutes")
        try:
            if self.nodes is not None:
                # a rank per GPU (or CPU slot), so that the node's units are leased as one call's; the node's
                # first rank runs the command (cli/node.py). Each attempt's time is its own: no call-wide limit.
                settings = Settings(
                    num_accelerators=self.nodes.per_node,
                    accelerator_type="GPU" if self.nodes.uses_gpu else "CPU",
                    num_nodes=self.nodes.nodes,
                    timeout=None,
                    max_restarts=self.max_retries,
                    watch=False,
                )
                settings.resolve()
                return settings
            settings = Settings(
                num_accelerators=compute.get("num_accelerators"),
                accelerator_type=compute.get("accelerator_type"),
                num_nodes=compute.get("num_nodes", 1),
                timeout=minutes * 60 if minutes else None,
                max_restarts=self.max_retries,
                env={"CODE_SOURCE_PATH": str(self.root), **(self.layer.env(dict(os.environ)) if self.layer else {})},
            )
            settings.resolve()
            return settings
        except AirMagicError as exc:  # the message names the setting; the file calls max_restarts max_retries
            raise JobFileError(str(exc).replace("max_restarts", "max_retries")) from None

    def spec(self) -> JobSpec:
        why = self.refusal()
        if why:
            raise JobFileError(why)
        settings = self.settings()
        if self.layer is not None:
            self.layer.on_sys_path()  # the function is imported here, and the ranks get this sys.path
        target, args, kwargs = self.target()
        if settings.num_nodes > 1:
            join_ray(settings.num_nodes, *([self.nodes.one_node()] if self.nodes is not None else []))
        return settings.spec(target, args, kwargs, self.name, origin="cli")

    def prepare(self, run_dir: Path) -> None:
        """Write into the call's run directory what its nodes read: the file as run, command.sh, the
        hyperparameters, the code snapshot and the workload's summary."""
        import yaml

        files = WorkloadDir(run_dir)
        files.config.write_text(yaml.safe_dump(self.data, sort_keys=False))
        if self.layer is not None and self.layer.log.exists():
            files.install_log.write_bytes(self.layer.log.read_bytes())
        if self.nodes is None:
            files.write_info(self.info())
            return
        files.command.write_text(self.data["command"])
        if self.data.get("parameters"):
            files.hyperparameters.write_text(self._hyperparameters() or "")
        if self.code is not None:
            self.code.take(files.code_source)
        files.write_info(self.info())

    def _hyperparameters(self) -> str | None:
        import yaml

        return yaml.safe_dump(self.data["parameters"], sort_keys=False) if self.data.get("parameters") else None

    def info(self) -> dict[str, Any]:
        """What `get` and `list` show of the workload beside the call."""
        compute = self.data.get("compute") or {}
        return {
            "experiment_name": self.experiment_name,
            "run_name": self.name,
            "job_file": str(self.path),
            "num_accelerators": compute.get("num_accelerators"),
            "accelerator_type": compute.get("accelerator_type"),
            "num_nodes": self.nodes.nodes if self.nodes is not None else compute.get("num_nodes", 1),
            "per_node": self.nodes.per_node if self.nodes is not None else compute.get("num_accelerators"),
            "max_retries": self.max_retries,
            "timeout_minutes": self.data.get("timeout_minutes"),
            "idempotency_token": self.idempotency_token,
            "kind": "command" if self.nodes is not None else "function",
        }

    def describe(self) -> dict[str, Any]:
        """What would run, for --dry-run: the nodes, the command, the variables, what would be installed."""
        out: dict[str, Any] = {
            "job_file": str(self.path),
            "experiment_name": self.experiment_name,
            "run_name": self.name,
        }
        if self.nodes is not None:
            out["nodes"] = self.nodes.nodes
            out["per_node"] = f"{self.nodes.per_node} x {self.nodes.accelerator_type}"
            out["command"] = self.data["command"]
            variables = ["NUM_NODES", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MLFLOW_RUN_ID"]
            variables += ["MLFLOW_TRACKING_URI", "POD_RANK", "IS_HOST", "LOCAL_ADDR"]  # cli/node.py node_env
            variables += ["CODE_SOURCE_PATH"] if self.code is not None else []
            variables += ["HYPERPARAMETERS_PATH"] if self.data.get("parameters") else []
            out["variables"] = variables + list(self.data.get("env_variables") or {})
            from . import secrets

            out["secrets"] = secrets.sources(self.data.get("secrets") or {})
        else:
            out["function"] = self.data["function"]
            out["args"] = self.data.get("args") or []
            out["kwargs"] = self.data.get("kwargs") or {}
        out["code_source"] = self.code.describe() if self.code is not None else None
        out["would_install"] = self.lacking
        out["install_into"] = self.layer.describe() if self.layer is not None else None
        out["max_retries"] = self.max_retries
        out["timeout_minutes"] = self.data.get("timeout_minutes")
        out["ignored_fields"] = self.notices
        out["on_this_machine"] = self.refusal() or "runs as written"
        return out


def load(path: str | os.PathLike[str], overrides: list[str] = (), say: Any = None) -> Job:  # type: ignore[assignment]
    """The checked workload of file `path` with `overrides` applied; JobFileError naming what is wrong.

    `say(line)` is told each override's change. Secrets are looked up by `resolve_secrets`, before the run
    starts."""
    file = Path(path).expanduser()
    data = read(file)
    for text in overrides:
        apply_override(data, text, say)
    schema.check(data)
    base = file.parent.resolve()
    code = snapshot.of(data.get("code_source"), base)
    nodes = topology.of(data["compute"]) if data.get("command") is not None else None
    if code is not None:
        code.check()
    wanted = dependencies.entries_of((data.get("environment") or {}).get("dependencies"), base)
    name = data.get("mlflow_run_name") or data.get("experiment_name")
    if not name:
        name = str(data.get("function", "")).partition(":")[2] or "job"
    job = Job(file, data, name, code, nodes, lacking=dependencies.missing(wanted, base), notices=schema.ignored(data))
    if job.lacking and dependencies.refusal(job.lacking, job.num_nodes) is None:  # installed at `run`
        job.layer = Layer.of(wanted, base, job.lacking)
    return job
