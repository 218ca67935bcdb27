"""`environment.dependencies`: the packages a workload needs, read as the runtime reads the list, which of them this
environment lacks, and the pip commands that install them.

Each entry is a pip requirement (`transformers>=4.40`), `-r requirements.txt` (relative to the workload file;
`$VARS` expanded), a `.whl` path (the same), a flag for the whole list (`--index-url`, `--extra-index-url`,
`--find-links`/`-f` with a value, `--no-index`), or flags for that entry (`--no-deps`, `--no-build-isolation`,
`--no-cache-dir`, `--force-reinstall`). The older form, a path to a YAML file `{version, dependencies}`, is read
too. `missing(entries, base)` gives the requirements that are not installed here in a version they allow;
`pip_installs` the `pip install` argument lists that install them (into the cached environment layered over this
one: cli/layer.py). `AIR_MAGIC_INSTALL=never` refuses instead. Not for: the field's form (cli/schema.py), the
cached environment itself (cli/layer.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import envvars
from .schema import JobFileError

#: Flags that apply to the whole install and take a value.
INDEX_FLAGS = ("--index-url", "--extra-index-url", "--find-links", "-f")
#: Flags that apply to the whole install, without a value.
WHOLE_FLAGS = ("--no-index",)
#: Flags that apply to the dependency of their entry.
NEXT_FLAGS = ("--no-deps", "--no-build-isolation", "--no-cache-dir", "--force-reinstall")


@dataclass(frozen=True)
class Entry:
    """One entry of the list: `kind` is "index" (a whole-list flag), "requirement", "file" (`-r`) or "wheel";
    `words` are pip's arguments for it (paths made absolute), `flags` its own flags, `path` the file it names."""

    kind: str
    words: tuple[str, ...]
    flags: tuple[str, ...] = ()
    path: Path | None = None

    @property
    def text(self) -> str:
        """The entry, normalized: its flags sorted, one space between words."""
        return " ".join([*self.flags, *self.words])


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


def _path(text: str, base: Path) -> Path:
    return (base / os.path.expandvars(os.path.expanduser(text.strip().strip("'\"")))).resolve()


def parse(entries: list[str], base: Path) -> list[Entry]:
    """The entries as pip reads them; JobFileError for a flag that is not taken."""
    parsed = []
    for entry in entries:
        words = entry.split()
        flags = sorted({w for w in words if w in NEXT_FLAGS})
        words = [w for w in words if w not in NEXT_FLAGS]
        if not words:
            continue
        first = words[0]
        if first == "--trusted-host":
            raise JobFileError("environment.dependencies: --trusted-host is not supported; use an https index")
        flag, _, value = first.partition("=")
        if flag in INDEX_FLAGS:
            value = value or " ".join(words[1:])
            if not value:
                raise JobFileError(f"environment.dependencies: {flag} needs a value: {entry!r}")
            parsed.append(Entry("index", (flag, value)))
        elif first in WHOLE_FLAGS:
            parsed.append(Entry("index", (first,)))
        elif first in ("-r", "--requirement") or first.startswith(("-r", "--requirement=")):
            rest = " ".join(words[1:]) if first in ("-r", "--requirement") else first.partition("=")[2] or first[2:]
            path = _path(rest, base)
            parsed.append(Entry("file", ("-r", str(path)), tuple(flags), path))
        elif first.startswith("-"):
            raise JobFileError(
                f"environment.dependencies: {first} is not taken here; the flags are {', '.join(INDEX_FLAGS)}, "
                f"{', '.join(WHOLE_FLAGS)} and, before a dependency, {', '.join(NEXT_FLAGS)}"
            )
        elif first.endswith(".whl"):
            path = _path(first, base)
            parsed.append(Entry("wheel", (str(path),), tuple(flags), path))
        else:
            parsed.append(Entry("requirement", (" ".join(words),), tuple(flags)))
    return parsed


def _requirements_file(path: Path) -> list[str]:
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


def _wants(entry: Entry) -> list[str]:
    """The requirements an entry asks for; a wheel's, `name==version` from its file name."""
    if entry.kind == "requirement":
        return list(entry.words)
    if entry.kind == "file" and entry.path is not None:
        return _requirements_file(entry.path)
    if entry.kind == "wheel" and entry.path is not None:
        parts = entry.path.name.split("-")
        return [f"{parts[0]}=={parts[1]}"] if len(parts) >= 2 else []
    return []


def _lacking(texts: list[str]) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import InvalidRequirement, Requirement

    lacking = []
    for text in texts:
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


def missing(entries: list[str], base: Path) -> list[str]:
    """The requirements and wheels of `entries` that this environment does not satisfy."""
    parsed = parse(entries, base)
    found = _lacking([text for entry in parsed if entry.kind != "wheel" for text in _wants(entry)])
    return found + _lacking([text for entry in parsed if entry.kind == "wheel" for text in _wants(entry)])


def pip_installs(entries: list[str], base: Path) -> list[list[str]]:
    """The `pip install` argument lists that install what `entries` ask for: the entries without flags of their
    own in one (every requirement this environment already satisfies with them, flags dropped: pip finds it
    installed, nothing is reinstalled), then one per set of flags; the whole-list flags in each."""
    parsed = parse(entries, base)
    whole = [word for entry in parsed if entry.kind == "index" for word in entry.words]
    plain: list[str] = []
    flagged: dict[tuple[str, ...], list[str]] = {}
    for entry in parsed:
        if entry.kind == "index":
            continue
        if entry.flags and _lacking(_wants(entry)):
            flagged.setdefault(entry.flags, []).extend(entry.words)
        else:
            plain.extend(entry.words)
    installs = [[*whole, *plain]] if plain else []
    return installs + [[*whole, *flags, *words] for flags, words in flagged.items()]


def installs() -> bool:
    """Whether `run` installs what the environment lacks (AIR_MAGIC_INSTALL unset or `auto`), or refuses (`never`)."""
    value = os.environ.get(envvars.INSTALL, "").strip().lower()
    if value not in ("", "auto", "never"):
        raise JobFileError(f"{envvars.INSTALL}={value!r}: leave it unset (or auto) to install, or set it to never")
    return value != "never"


def refusal(lacking: list[str], num_nodes: int = 1) -> str | None:
    """Why a workload whose environment lacks `lacking` cannot run here, or None (they are installed at `run`)."""
    if not lacking:
        return None
    what = f"environment.dependencies: not installed in {sys.prefix}: {', '.join(lacking)}"
    if not installs():
        return (
            f"{what}; {envvars.INSTALL}=never: install them into this environment (pip install ...) and run again, "
            "or unset it to have them installed into a cached environment"
        )
    if num_nodes > 1:
        return (
            f"{what}; the cached environment they would be installed into is this machine's only, and the workload "
            f"runs on {num_nodes} nodes: install them into the environment of every node of the cluster and run again"
        )
    return None
