"""`environment.dependencies`: the packages a workload needs, read as the runtime reads the list, and which of
them this environment lacks.

Each entry is a pip requirement (`transformers>=4.40`), `-r requirements.txt` (relative to the workload file;
`$VARS` expanded), a `.whl` path, an index flag for the whole list (`--index-url`, `--extra-index-url`,
`--find-links`/`-f`), or a flag for the next entry (`--no-deps`, `--no-build-isolation`, `--no-cache-dir`,
`--force-reinstall`). The older form, a path to a YAML file `{version, dependencies}`, is read too.
`missing(entries, base)` gives the requirements that are not installed here in a version they allow: nothing
is installed into your environment; `run` refuses a workload that lacks any, naming them. Not for: the
field's form (cli/schema.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from .schema import JobFileError

#: Flags that apply to the whole install (they take a value).
INDEX_FLAGS = ("--index-url", "--extra-index-url", "--find-links", "-f")
#: Flags that apply to the next dependency.
NEXT_FLAGS = ("--no-deps", "--no-build-isolation", "--no-cache-dir", "--force-reinstall")


def entries_of(value: Any, base: Path) -> list[str]:
    """The list form of `environment.dependencies` (a legacy file path is read)."""
    if value is None:
        return []
    if isinstance(value, list):
        return [str(v) for v in value]
    import yaml

    path = (base / os.path.expandvars(os.path.expanduser(value))).resolve()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise JobFileError(
            f"environment.dependencies: cannot read {path} ({exc.strerror or exc}); give the packages as a list"
        ) from None
    except yaml.YAMLError as exc:
        raise JobFileError(f"environment.dependencies: {path} is not valid YAML: {exc}") from None
    deps = data.get("dependencies") if isinstance(data, dict) else data
    if not isinstance(deps, list):
        raise JobFileError(f"environment.dependencies: {path} must hold a list under 'dependencies'")
    return [str(d) for d in deps]


def _requirements_file(text: str, base: Path) -> list[str]:
    path = (base / os.path.expandvars(os.path.expanduser(text.strip().strip("'\"")))).resolve()
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise JobFileError(f"environment.dependencies: -r {path}: {exc.strerror or exc}") from None
    found = []
    for line in lines:
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            found.append(line)
    return found


def requirements(entries: list[str], base: Path) -> tuple[list[str], list[str]]:
    """(requirements, wheel paths) of the entries; flags are read and left for the installer."""
    reqs: list[str] = []
    wheels: list[str] = []
    for entry in entries:
        words = entry.split()
        while words and words[0] in NEXT_FLAGS:
            words = words[1:]
        if not words:
            continue
        if words[0] == "--trusted-host":
            raise JobFileError("environment.dependencies: --trusted-host is not supported; use an https index")
        if words[0] in INDEX_FLAGS or words[0].startswith(tuple(f"{f}=" for f in INDEX_FLAGS)):
            continue
        if words[0] == "-r" or words[0].startswith("-r"):
            rest = " ".join(words[1:]) if words[0] == "-r" else words[0][2:] + " ".join(words[1:])
            reqs += _requirements_file(rest, base)
        elif words[0].endswith(".whl"):
            wheels.append(words[0])
        else:
            reqs.append(" ".join(words))
    return reqs, wheels


def missing(entries: list[str], base: Path) -> list[str]:
    """The requirements and wheels of `entries` that this environment does not satisfy."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import InvalidRequirement, Requirement

    reqs, wheels = requirements(entries, base)
    for wheel in wheels:  # name-version-...whl: the distribution and version it installs
        parts = Path(wheel).name.split("-")
        if len(parts) >= 2:
            reqs.append(f"{parts[0]}=={parts[1]}")
    lacking = []
    for text in reqs:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            raise JobFileError(f"environment.dependencies: {text!r} is not a requirement: {exc}") from None
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            found = version(req.name)
        except PackageNotFoundError:
            lacking.append(text)
            continue
        if req.specifier and not req.specifier.contains(found, prereleases=True):
            lacking.append(f"{text} ({req.name} {found} is installed)")
    return lacking


def refusal(lacking: list[str]) -> str:
    return (
        f"environment.dependencies: not installed in {sys.prefix}: {', '.join(lacking)}; install them into this "
        "environment (pip install ...) and run again"
    )
