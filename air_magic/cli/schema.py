"""The fields of a workload file, as the runtime's workload YAML reference names them, and their checks.

`check(data)` walks the file's mapping against `FIELDS` and raises `JobFileError` at the first field that is
unknown (with the close name: "did you mean"), of the wrong kind, or out of the runtime's bounds, in the order
the fields are declared, as the runtime's CLI does. `ignored(data)` names the fields that are accepted but have
no meaning on one machine (a Docker image, a Unity Catalog volume, permissions, a billing policy, a capacity
pool). The fields themselves are listed in cli/fields.py. Not for: what the fields mean at run time (cli/jobfile.py,
cli/topology.py) or reading the file (cli/jobfile.py).
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from ..errors import AirMagicError
from .fields import BOOL, FIELDS, IGNORED, INT, LIST, MAP, REFUSED, RENAMED, STR


class JobFileError(AirMagicError):
    """The workload file cannot run as written; the message names the field (exit code 2, nothing started)."""


_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_BRANCH = re.compile(r"^[\w./-]+$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _suggest(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(known)}"


def _is(kind: str, value: Any) -> bool:
    if kind == STR:
        return isinstance(value, str)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == LIST:
        return isinstance(value, list)
    if kind == MAP:
        return isinstance(value, dict)
    return True


def _walk(data: dict[str, Any], known: dict[str, Any], where: str) -> None:
    for key, value in data.items():
        path = f"{where}{key}"
        if path in RENAMED:
            raise JobFileError(f"{path!r} is not a field of the workload file; use {RENAMED[path]}")
        if path in REFUSED:
            raise JobFileError(f"{path!r} is not supported on this machine: {REFUSED[path]}")
        if key not in known:
            raise JobFileError(f"unknown field {path!r}{_suggest(str(key), known)}")
        kind = known[key]
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                raise JobFileError(f"{path} must be a mapping of {', '.join(kind)}, got {value!r}")
            _walk(value, kind, f"{path}.")
        elif value is not None and not _is(kind, value):
            raise JobFileError(f"{path} must be {kind}, got {value!r}")


def _name(data: dict[str, Any], field: str, limit: int) -> None:
    value = data.get(field)
    if value is None:
        return
    if not value or len(value) > limit or not _NAME.match(value):
        raise JobFileError(f"{field} must be 1 to {limit} characters of letters, digits, '_' and '-', got {value!r}")


def _check_environment(env: dict[str, Any]) -> None:
    if env.get("docker_image") is not None and (env.get("dependencies") or env.get("version") is not None):
        raise JobFileError(
            "environment.docker_image supplies the whole environment: leave out environment.dependencies and "
            "environment.version, or the image"
        )
    image = env.get("docker_image")
    if image is not None and not image.get("url"):
        raise JobFileError("environment.docker_image.url is required with environment.docker_image")
    deps = env.get("dependencies")
    if env.get("version") is not None and not isinstance(deps, list):
        raise JobFileError("'environment.version' requires inline 'dependencies' (a list of packages)")
    if deps is not None and not isinstance(deps, (list, str)):
        raise JobFileError(
            f"environment.dependencies must be a list of packages (pip specs, -r requirements.txt, .whl paths), "
            f"got {deps!r}"
        )
    if isinstance(deps, list) and not all(isinstance(d, str) and d.strip() for d in deps):
        raise JobFileError(f"environment.dependencies: every entry must be a non-empty string, got {deps!r}")


def _check_variables(data: dict[str, Any]) -> None:
    env = data.get("env_variables") or {}
    for name, value in env.items():
        if not _ENV_NAME.match(str(name)):
            raise JobFileError(f"env_variables: {name!r} is not a variable name (letters, digits and '_')")
        if isinstance(value, (dict, list)):
            raise JobFileError(f"env_variables.{name} must be a string, got {value!r}")
    secrets = data.get("secrets") or {}
    for name, ref in secrets.items():
        if not _ENV_NAME.match(str(name)):
            raise JobFileError(f"secrets: {name!r} is not a variable name (letters, digits and '_')")
        parts = ref.split("/") if isinstance(ref, str) else []
        if len(parts) != 2 or not all(parts):
            raise JobFileError(f"secrets.{name} must be 'scope/key' (exactly one '/'), got {ref!r}")
        if name in env:
            raise JobFileError(f"{name} is in both env_variables and secrets; keep one")


def _check_code_source(source: dict[str, Any]) -> None:
    if source.get("type") != "snapshot":
        raise JobFileError(f"code_source.type must be 'snapshot' (the only type), got {source.get('type')!r}")
    snapshot = source.get("snapshot")
    if not snapshot:
        raise JobFileError("code_source.snapshot is required with code_source.type: snapshot (with root_path)")
    if not snapshot.get("root_path"):
        raise JobFileError("code_source.snapshot.root_path is required: the local directory to snapshot")
    volume = snapshot.get("remote_volume")
    if volume is not None and not str(volume).startswith("/Volumes/"):
        raise JobFileError(f"code_source.snapshot.remote_volume must start with /Volumes/, got {volume!r}")
    git = snapshot.get("git")
    if git is not None:
        if ("branch" in git) == ("commit" in git):
            raise JobFileError("code_source.snapshot.git needs exactly one of branch or commit")
        if "branch" in git and not _BRANCH.match(str(git["branch"] or "")):
            raise JobFileError(f"code_source.snapshot.git.branch is not a branch name: {git['branch']!r}")
        if "commit" in git and not git["commit"]:
            raise JobFileError("code_source.snapshot.git.commit must not be empty")
        if git.get("remote") not in (None, False):
            raise JobFileError(
                "code_source.snapshot.git.remote is no longer supported: the snapshot is taken from the local "
                "repository; leave it out or set it to false"
            )
    paths = snapshot.get("include_paths")
    if paths is not None:
        if not paths:
            raise JobFileError("code_source.snapshot.include_paths must not be empty; leave it out for everything")
        for entry in paths:
            if not isinstance(entry, str) or not entry or entry.startswith("/") or ".." in entry.split("/"):
                raise JobFileError(
                    f"code_source.snapshot.include_paths: {entry!r} must be a relative path inside root_path"
                )


def _check_grants(permissions: list[Any]) -> None:
    for grant in permissions:
        principals = [k for k in ("user_name", "group_name", "service_principal_name") if (grant or {}).get(k)]
        if not isinstance(grant, dict) or len(principals) != 1 or not grant.get("level"):
            raise JobFileError(
                f"permissions: each entry needs exactly one of user_name, group_name or service_principal_name, "
                f"and a level, got {grant!r}"
            )


def check(data: dict[str, Any]) -> None:
    """Every field of `data` is known, of its kind and within the runtime's bounds; JobFileError at the first
    that is not."""
    _walk(data, FIELDS, "")
    has_command, has_function = data.get("command") is not None, data.get("function") is not None
    if has_command and has_function:
        raise JobFileError("give exactly one of 'command' (bash, once per node) or 'function' (module:name)")
    if not has_command and not has_function:
        raise JobFileError("command is required: the bash command each node runs (or function: module:name)")
    if has_function and ":" not in str(data["function"]):
        raise JobFileError(f"function must be 'module:name', got {data['function']!r}")
    if has_command:
        if "args" in data or "kwargs" in data:
            raise JobFileError("args and kwargs go with 'function', not with 'command'")
        if not str(data["command"]).strip():
            raise JobFileError("command is required: the bash command each node runs")
        if len(str(data["command"]).splitlines()) > 1000:
            raise JobFileError(
                "command is longer than 1000 lines; move complex logic into a script in your code_source"
            )
        if not data.get("experiment_name"):
            raise JobFileError("experiment_name is required: the MLflow experiment the run is logged to")
        if not data.get("compute"):
            raise JobFileError("compute: section is required (num_accelerators and accelerator_type)")
    _name(data, "experiment_name", 100)
    _name(data, "mlflow_run_name", 100)
    _check_environment(data.get("environment") or {})
    _check_variables(data)
    if data.get("code_source") is not None:
        _check_code_source(data["code_source"])
    retries = data.get("max_retries")
    if retries is not None and retries < 0:
        raise JobFileError(f"max_retries must be 0 or more (0: no retries), got {retries}")
    minutes = data.get("timeout_minutes")
    if minutes is not None and minutes < 1:
        raise JobFileError(f"timeout_minutes must be >= 1, got {minutes}")
    token = data.get("idempotency_token")
    if token is not None and not (0 < len(token) <= 64):
        raise JobFileError(f"idempotency_token must be 1 to 64 characters, got {len(token)}")
    directory = data.get("mlflow_experiment_directory")
    if directory is not None and not directory.startswith("/Workspace"):
        raise JobFileError(f"mlflow_experiment_directory must start with /Workspace, got {directory!r}")
    _check_grants(data.get("permissions") or [])
    if data.get("usage_policy_name") is not None and data.get("usage_policy_id") is not None:
        raise JobFileError("give usage_policy_name or usage_policy_id, not both")
    if len(data.get("usage_policy_name") or "") > 127:
        raise JobFileError("usage_policy_name must be at most 127 characters")
    policy = data.get("usage_policy_id")
    if policy is not None and not _UUID.match(policy):
        raise JobFileError(f"usage_policy_id must be a UUID (8-4-4-4-12 hex digits), got {policy!r}")


def ignored(data: dict[str, Any]) -> list[str]:
    """The fields of `data` that are accepted but mean nothing on one machine, in declaration order."""
    found = []
    for path in IGNORED:
        node: Any = data
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            found.append(path)
    return found
