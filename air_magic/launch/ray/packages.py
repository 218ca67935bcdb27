"""Before a Ray call's ranks start: the nodes' installed packages against the notebook's, made good or refused.

The distributions compared are those the notebook has imported (a module in
`sys.modules` that an installed distribution provides), less what the kernel
itself runs on (IPython, ipykernel, Jupyter and what they require). Each node
that could hold the call is asked once per notebook, by a small Ray task on
that node, which version of each it has (None: not installed); the answers
are kept per node, so later calls ask nothing.

A difference is handled as `ray_init(packages=...)` says:
- "sync" (the default): the call's actors get a Ray runtime environment whose
  `py_modules` are the notebook's own installed files of each differing
  distribution (its packages and its metadata), so every rank imports the
  notebook's exact version. Ray uploads them once and each node unpacks them
  once (a second call reuses both). A distribution that cannot be carried
  (a single-file module, an editable install, over 100 MiB) is refused as below.
- "check": the call is refused before any rank starts, with an error that
  names each package, node and version and the way out.
- "off": nothing is compared.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ._compat import upload_py_modules
from .cluster import alive_nodes, packages_mode
from .placement import LaunchError

#: Distributions the kernel runs on, not the user's code: never compared.
KERNEL_ROOTS = ("ipykernel", "ipython", "ipywidgets", "jupyter-client", "jupyter-server", "notebook", "jupyterlab")
#: Ray's limit on one `py_modules` entry.
SYNC_LIMIT = 100 * 2**20
#: (node id, distribution) -> the version the node has, None if it has none.
_probed: dict[tuple[str, str], str | None] = {}
#: Distribution files uploaded, by (name, version): the runtime environment's URIs.
_uploaded: dict[tuple[str, str], list[str]] = {}
_lock = threading.Lock()
#: What `_installed` read, and the sys.path directories' times it was read at.
_seen: tuple[list[tuple[str, int]], dict[str, list[str]], dict[str, str]] | None = None


@dataclass(frozen=True)
class Difference:
    """One distribution a node has in another version than the notebook, or not at all."""

    dist: str
    want: str
    have: str | None
    node: str

    def __str__(self) -> str:
        there = "missing" if self.have is None else self.have
        return f"{self.dist} {self.want} here, {there} on node {self.node}"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@lru_cache(maxsize=1)
def _kernel_closure() -> frozenset[str]:
    """KERNEL_ROOTS and everything they require (installed here), canonical names."""
    seen: set[str] = set()
    todo = list(KERNEL_ROOTS)
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            if "extra ==" not in line and (found := re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)):
                todo.append(found.group(0))
    return frozenset(seen)


def _installed() -> tuple[dict[str, list[str]], dict[str, str]]:
    """Top-level module -> its distributions, and distribution -> version: read again only when a `sys.path`
    directory changed (a `%pip install` adds to one), as reading them takes a few tenths of a second."""
    global _seen
    stamp = []
    for entry in sys.path:
        with contextlib.suppress(OSError):
            stamp.append((entry, os.stat(entry or ".").st_mtime_ns))
    seen = _seen
    if seen is None or seen[0] != stamp:
        owners = dict(importlib.metadata.packages_distributions())
        versions = {}
        for dist in importlib.metadata.distributions():
            name = dist.metadata["Name"]
            if name and name not in versions:  # the first on sys.path is the one imported
                versions[name] = dist.version
        seen = _seen = (stamp, owners, versions)
    return seen[1], seen[2]


def notebook_distributions() -> dict[str, str]:
    """Distribution -> version, for each installed distribution this process has imported a module of."""
    tops = {name.split(".")[0] for name in list(sys.modules)} - set(sys.stdlib_module_names)
    owners, versions = _installed()
    skip = _kernel_closure()
    found: dict[str, str] = {}
    for top in tops:
        for dist in owners.get(top, []):
            if _canonical(dist) not in skip and dist in versions:
                found[dist] = versions[dist]
    return found


def _node_name(node: dict[str, Any]) -> str:
    return f"{node.get('NodeManagerAddress', '?')} ({node['NodeID'][:8]})"


def differences(ray: Any, want: dict[str, str], nodes: list[dict[str, Any]], probe: Any) -> list[Difference]:
    """What each node has of `want` that differs (asked of nodes not asked before; `probe` is the node task)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    asks = {}
    for node in nodes:
        missing = sorted(d for d in want if (node["NodeID"], d) not in _probed)
        if missing:
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            asks[node["NodeID"]] = (missing, probe.options(scheduling_strategy=strategy).remote(missing))
    for node_id, (names, ref) in asks.items():
        for name, version in zip(names, ray.get(ref, timeout=120)):
            _probed[(node_id, name)] = version
    return [
        Difference(dist, version, _probed[(n["NodeID"], dist)], _node_name(n))
        for n in nodes
        for dist, version in sorted(want.items())
        if _probed[(n["NodeID"], dist)] != version
    ]


def _files_of(dist: str) -> list[str] | None:
    """The directories to carry for `dist`: its top-level packages and its metadata; None if that is not possible."""
    found = importlib.metadata.distribution(dist)
    meta = getattr(found, "_path", None)
    if meta is None or not os.path.isdir(meta):
        return None
    site = os.path.dirname(str(meta))
    tops = {str(f).split("/")[0] for f in found.files or [] if not str(f).startswith((".", "__pycache__"))}
    paths = [str(meta)]
    for top in sorted(tops - {os.path.basename(str(meta))}):
        path = os.path.join(site, top)
        if top.endswith((".py", ".pth")) or not os.path.isdir(path):
            if top.endswith(".py"):
                return None  # a single-file module cannot be a py_modules entry
            continue
        paths.append(path)
    if len(paths) == 1:
        return None  # no package directory of its own (an editable install points elsewhere): nothing to bring
    total = sum(os.path.getsize(os.path.join(d, f)) for p in paths for d, _, fs in os.walk(p) for f in fs)
    return paths if total <= SYNC_LIMIT else None


def _job_py_modules(ray: Any) -> list[str]:
    """The `py_modules` of the job's own runtime environment (ray_init(runtime_env=...)): an actor's replace them."""
    try:
        return list(ray.get_runtime_context().runtime_env.get("py_modules") or [])
    except Exception:  # noqa: BLE001 - none, or a context that does not say
        return []


def prepare(ray: Any, bundle: dict[str, float], probe: Any) -> dict[str, Any] | None:
    """The runtime environment the call's actors need (None: none), or a LaunchError saying what differs."""
    mode = packages_mode()
    if mode == "off":
        return None
    want = notebook_distributions()
    nodes = [n for n in alive_nodes(ray) if all(n.get("Resources", {}).get(k, 0) >= v for k, v in bundle.items())]
    with _lock:
        found = differences(ray, want, nodes, probe)
        if not found:
            return None
        if mode == "sync":
            uris: list[str] = []
            stuck = set()
            for dist in sorted({d.dist for d in found}):
                key = (dist, want[dist])
                if key not in _uploaded:
                    paths = _files_of(dist)
                    if paths is None:
                        stuck.add(dist)
                        continue
                    _uploaded[key] = upload_py_modules(paths)
                uris += _uploaded[key]
            if not stuck:
                return {"py_modules": [*_job_py_modules(ray), *uris]}
            found = [d for d in found if d.dist in stuck]
    wanted = " ".join(sorted({f"'{d.dist}=={d.want}'" for d in found}))
    how = f"Install the notebook's versions on those nodes (pip install {wanted})"
    if mode == "sync":
        how = f"They cannot be brought with the call (a single-file module, an editable install, over 100 MiB). {how}"
    else:
        how += ", or call ray_init(..., packages='sync') to bring them with each call"
    raise LaunchError(
        f"the Ray nodes' packages differ from this notebook's: {'; '.join(map(str, found))}. No rank was started. "
        f"{how}; ray_init(..., packages='off') runs calls with the nodes' packages as they are."
    )
