"""The workload file of `air-magic run -f job.yaml`: its fields (the runtime's names), their checks, and the JobSpec.

`load(path, overrides)` reads the YAML file, applies `--override KEY=VALUE`, and checks every field before
anything starts: an unknown or misspelled field (with the close name), a missing file or directory, a bad
value or a dependency that is not installed is a `JobFileError` naming it. `Job.spec()` builds the same
`JobSpec` as the notebook's doors (decorator.Settings), so the call takes the same path: `command` becomes
`run_command` on every rank, `function: module:name` the function itself. Not for: starting or following
the call (cli/main.py, calls/detached.py).
"""

from __future__ import annotations

import difflib
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..decorator import DEFAULT_TIMEOUT, Settings
from ..errors import AirMagicError
from ..job import JobSpec

#: Every field the file takes, and the fields of its sections.
FIELDS: dict[str, Any] = {
    "experiment_name": str,
    "compute": {"num_accelerators": int, "accelerator_type": str, "num_nodes": int},
    "command": str,
    "function": str,
    "args": list,
    "kwargs": dict,
    "code_source": {"root_path": str},
    "environment": {"dependencies": list},
    "mlflow_run_name": str,
    "max_retries": int,
    "timeout": (int, float, type(None)),
}


class JobFileError(AirMagicError):
    """The workload file cannot run as written; the message names the field (exit code 2, nothing started)."""


class CommandFailed(RuntimeError):
    """A workload's `command` ended with a non-zero exit code on a rank."""


def run_command(command: str, root: str) -> int:
    """What each rank runs for a `command` workload: the shell command in `root`, with the rank's torchrun
    variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), MLflow's run and $CODE_SOURCE_PATH, and
    this environment's `python` first on PATH."""
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, "CODE_SOURCE_PATH": root}
    # `python` in the command is this environment's, as in an activated virtual environment
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    # a script's `mlflow.log_metric` is written before the script exits, whether or not it ends its run
    env["MLFLOW_ENABLE_ASYNC_LOGGING"] = "false"
    code = subprocess.call(["/bin/sh", "-c", command], cwd=root, env=env)
    if code != 0:
        raise CommandFailed(f"the command exited with code {code}: {command}")
    return code


def _close(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(sorted(known))}"


def _check_fields(data: dict[str, Any], known: dict[str, Any], where: str = "") -> None:
    for key, value in data.items():
        path = f"{where}{key}"
        if key not in known:
            raise JobFileError(f"unknown field {path!r}{_close(str(key), known)}")
        kind = known[key]
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                raise JobFileError(f"{path} must be a mapping of {', '.join(kind)}, got {value!r}")
            _check_fields(value, kind, f"{path}.")
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            name = kind.__name__ if isinstance(kind, type) else "a number or null"
            raise JobFileError(f"{path} must be {name}, got {value!r}")


def apply_override(data: dict[str, Any], text: str) -> None:
    """`compute.num_accelerators=2` into `data` (the value read as YAML: 2 is a number, CPU a string)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise JobFileError(f"--override {text!r} must be KEY=VALUE, such as compute.num_accelerators=2")
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise JobFileError(f"--override {text!r}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise JobFileError(f"--override {text!r}: the value is not valid: {exc}") from None


def check_dependencies(requirements: list[Any]) -> None:
    """Each requirement ("torch>=2.4") is installed here in a version it allows, else a JobFileError naming it."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import InvalidRequirement, Requirement

    for text in requirements:
        try:
            req = Requirement(str(text))
        except InvalidRequirement as exc:
            raise JobFileError(f"environment.dependencies: {text!r} is not a requirement: {exc}") from None
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            found = version(req.name)
        except PackageNotFoundError:
            raise JobFileError(
                f"environment.dependencies: {text!r} is not installed in {sys.prefix}; install it "
                f"(pip install {str(text)!r}) and run again"
            ) from None
        if req.specifier and not req.specifier.contains(found, prereleases=True):
            raise JobFileError(f"environment.dependencies: {text!r} is not satisfied: {req.name} {found} is installed")


def join_ray(num_nodes: int) -> None:
    """Join the Ray cluster of $RAY_ADDRESS, else the one started on this machine with `ray start` ("auto")."""
    from ..launch import ray_init

    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray_init(address, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - any failure to join is said the same way
        raise JobFileError(
            f"compute.num_nodes: {num_nodes} runs on a Ray cluster, and joining {address!r} failed "
            f"({type(exc).__name__}: {exc}); start one with `ray start --head` or set RAY_ADDRESS"
        ) from None


@dataclass
class Job:
    """A checked workload file."""

    path: Path
    data: dict[str, Any]
    root: Path
    settings: Settings
    name: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def experiment_name(self) -> str | None:
        return self.data.get("experiment_name")

    def target(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """What every rank runs: `run_command(command, root)`, or the function with its args and kwargs."""
        if "command" in self.data:
            return run_command, (self.data["command"], str(self.root)), {}
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

    def spec(self) -> JobSpec:
        target, args, kwargs = self.target()
        if self.settings.num_nodes > 1:
            join_ray(self.settings.num_nodes)
        return self.settings.spec(target, args, kwargs, self.name, origin="cli")

    def describe(self) -> dict[str, Any]:
        """What would run, for --dry-run."""
        s = self.settings
        return {
            "job_file": str(self.path),
            "name": self.name,
            "experiment_name": self.experiment_name,
            "command": self.data.get("command"),
            "function": self.data.get("function"),
            "args": self.data.get("args") or [],
            "kwargs": self.data.get("kwargs") or {},
            "root_path": str(self.root),
            "num_accelerators": s.num_accelerators,
            "accelerator_type": s.accelerator_type,
            "num_nodes": s.num_nodes,
            "max_retries": s.max_restarts,
            "timeout": s.timeout,
        }


def load(path: str | os.PathLike[str], overrides: list[str] = ()) -> Job:  # type: ignore[assignment]
    """The checked workload of file `path` with `overrides` applied; JobFileError naming what is wrong."""
    import yaml

    file = Path(path).expanduser()
    try:
        data = yaml.safe_load(file.read_text())
    except FileNotFoundError:
        raise JobFileError(f"no such job file: {file}") from None
    except OSError as exc:
        raise JobFileError(f"cannot read the job file {file}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise JobFileError(f"{file} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise JobFileError(f"{file} must hold a mapping of fields (experiment_name, compute, command, ...)")
    for text in overrides:
        apply_override(data, text)
    _check_fields(data, FIELDS)
    if ("command" in data) == ("function" in data):
        raise JobFileError("give exactly one of 'command' (a shell command) or 'function' (module:name)")
    if "function" in data and ":" not in data["function"]:
        raise JobFileError(f"function must be 'module:name', got {data['function']!r}")
    if "command" in data and ("args" in data or "kwargs" in data):
        raise JobFileError("args and kwargs go with 'function', not with 'command'")
    root_text = (data.get("code_source") or {}).get("root_path")
    root = (file.parent / os.path.expanduser(root_text)).resolve() if root_text else file.parent.resolve()
    if not root.is_dir():
        raise JobFileError(f"code_source.root_path: no such directory: {root}")
    check_dependencies((data.get("environment") or {}).get("dependencies") or [])
    compute = data.get("compute") or {}
    try:
        settings = Settings(
            num_accelerators=compute.get("num_accelerators"),
            accelerator_type=compute.get("accelerator_type"),
            num_nodes=compute.get("num_nodes", 1),
            timeout=data.get("timeout", DEFAULT_TIMEOUT),
            max_restarts=data.get("max_retries", 0),
            env={"CODE_SOURCE_PATH": str(root)},
        )
        settings.resolve()
    except AirMagicError as exc:  # the message names the setting; the file calls max_restarts max_retries
        raise JobFileError(str(exc).replace("max_restarts", "max_retries")) from None
    default = data.get("function", "").partition(":")[2] or str(data.get("command", "command")).split()[0]
    name = data.get("mlflow_run_name") or Path(default).name or "job"
    return Job(file, data, root, settings, name)
