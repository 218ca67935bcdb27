"""Which modules of the notebook are its own code, and what that code is as the notebook runs it.

A module the notebook imported from a file that no installed distribution
provides and that lies outside site-packages and the standard library (a
`helpers.py` beside the notebook, a package folder on a `sys.path` entry of
the user's) is the notebook's own: it travels with every call, pickled by
value (payload.py) and as code a rank imports by name (launch/rank/carried.py).
This module finds those modules and reads their code as the notebook
imported it (`remember`, after every cell and at every call; again after
`importlib.reload`), so that a rank runs what the notebook runs even when the
file was edited since, or deleted. Everything else is imported by name on
the ranks. It does not pickle anything and starts nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import site
import sys
import sysconfig
from functools import lru_cache
from types import ModuleType

from .launch.rank.carried import Carried, Module


@lru_cache(maxsize=1)
def _installed_roots() -> tuple[str, ...]:
    """Directories whose modules are installed (site-packages, the standard library, the interpreter's prefixes)."""
    paths = {*sysconfig.get_paths().values(), *site.getsitepackages(), site.getusersitepackages()}
    paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return tuple(os.path.join(os.path.realpath(p), "") for p in paths if p and os.path.realpath(p) != os.sep)


@lru_cache(maxsize=1)
def _distributed_names() -> frozenset[str]:
    """Top-level names that installed distributions provide (editable installs included)."""
    return frozenset(importlib.metadata.packages_distributions())


@lru_cache(maxsize=256)
def _holds_distributions(directory: str) -> bool:
    """A directory where packages are installed (`pip install --target`, a conda or system prefix): it holds
    the metadata of some distribution."""
    try:
        return any(entry.endswith(".dist-info") for entry in os.listdir(directory))
    except OSError:
        return False


def _installed_tree(directory: str) -> bool:
    """`directory` is an install directory or lies inside one (a package's vendored copy of another, which it
    puts on sys.path itself, as debugpy does with pydevd)."""
    while True:
        if _holds_distributions(directory):
            return True
        parent = os.path.dirname(directory)
        if parent == directory:
            return False
        directory = parent


def _top_directory(name: str, real: str) -> str:
    """The sys.path directory a top-level module `name` was found in, from its file's real path."""
    parent = os.path.dirname(real)
    return os.path.dirname(parent) if os.path.basename(real).startswith("__init__.") else parent


_OWN_PACKAGE = __name__.split(".")[0]
#: Modules the interpreter imports at start-up from its own configuration, never the notebook's code.
_SITE_HOOKS = frozenset({"sitecustomize", "usercustomize"})
#: Top-level module name and file -> whether it travels by value (a file is judged once).
_judged: dict[tuple[str, str], bool] = {}


def _travels_by_value(name: str, module: ModuleType) -> bool:
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or name in (_OWN_PACKAGE, "__main__", "__mp_main__"):
        return False
    known = _judged.get((name, file))
    if known is None:
        real = os.path.realpath(file)
        known = (
            real.endswith(".py")  # compiled extensions cannot travel by value
            and name not in sys.stdlib_module_names
            and not real.startswith(_installed_roots())
            and name not in _distributed_names()
            and name not in _SITE_HOOKS
            and not _installed_tree(_top_directory(name, real))
        )
        _judged[(name, file)] = known
    return known


def notebook_modules() -> list[ModuleType]:
    """Top-level modules this process imported from files that are not installed packages: they travel by value."""
    return [
        m for name, m in list(sys.modules.items()) if "." not in name and m is not None and _travels_by_value(name, m)
    ]


#: Carry the .py files of a notebook package that the notebook has not imported (yet) while they add up to
#: no more than this many bytes (a rank may import them by name); a larger package carries only what it imported.
PACKAGE_FILES_BYTES = 4 * 2**20
#: Module name -> the spec it was imported (or last reloaded) with, and its code read then.
_remembered: dict[str, tuple[object, Module]] = {}
#: Files of packages read as they are on disk, by (path, mtime, size).
_read_cache: dict[tuple[str, int, int], Module | None] = {}


def _read(file: str, package: bool) -> Module | None:
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return Module(file=file, package=package, data=data, digest=hashlib.sha256(data).hexdigest()[:32])


def _members(tops: set[str]) -> list[tuple[str, ModuleType]]:
    return [(n, m) for n, m in list(sys.modules.items()) if m is not None and n.split(".")[0] in tops]


def remember(*_: object) -> None:
    """Read the code of every notebook module imported or reloaded since the last time.

    Called after each notebook cell (an IPython `post_run_cell` hook) and at each call, so that what travels
    is the code as the notebook imported it: a file edited and not reloaded, or deleted, since then does not
    change what the ranks run. `importlib.reload` gives the module a new spec, and its code is read again.
    """
    with contextlib.suppress(Exception):  # it runs after every cell: never the cause of an error there
        for name, module in _members({m.__name__ for m in notebook_modules()}):
            spec, file = getattr(module, "__spec__", None), getattr(module, "__file__", None)
            known = _remembered.get(name)
            if known is not None and known[0] is spec or not isinstance(file, str) or not file.endswith(".py"):
                continue
            found = _read(file, hasattr(module, "__path__"))
            if found is not None:
                _remembered[name] = (spec, found)


def arm() -> None:
    """In an IPython kernel, remember the notebook's modules after every cell from now on, and those imported so far.

    `import air_magic` calls it, so the decorator alone (no `%load_ext air_magic`) carries the notebook's code as
    the magic does. It never imports IPython: outside a kernel (a script, a rank) it does nothing.
    """
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    events = getattr(shell, "events", None)
    if events is None:
        return
    if remember not in events.callbacks.get("post_run_cell", []):
        events.register("post_run_cell", remember)
    remember()


def _package_files(name: str, init: str) -> dict[str, str]:
    """Module name -> file of every .py file of the package `name` (whose `__init__.py` is `init`), within the cap."""
    found: dict[str, str] = {}
    root, total = os.path.dirname(init), 0
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")) and os.path.isfile(f"{here}/{d}/__init__.py"))
        parts = os.path.relpath(here, root).split(os.sep)
        prefix = ".".join([name, *(p for p in parts if p != ".")])
        for file in sorted(files):
            if not file.endswith(".py") or not file[:-3].isidentifier():
                continue
            path = os.path.join(here, file)
            with contextlib.suppress(OSError):
                total += os.path.getsize(path)
            if total > PACKAGE_FILES_BYTES:
                return {}
            found[prefix if file == "__init__.py" else f"{prefix}.{file[:-3]}"] = path
    return found


def _on_disk(file: str, package: bool) -> Module | None:
    try:
        st = os.stat(file)
    except OSError:
        return None
    key = (file, st.st_mtime_ns, st.st_size)
    if key not in _read_cache:
        _read_cache[key] = _read(file, package)
    return _read_cache[key]


def carried_modules() -> Carried:
    """The code of every notebook module (see `notebook_modules`) and its submodules, for `import` on the ranks.

    Imported modules travel as the notebook imported them (see `remember`); the other .py files of a notebook
    package (within PACKAGE_FILES_BYTES) as they are on disk now.
    """
    remember()
    tops = [m for m in notebook_modules()]
    carried: Carried = {}
    for name, module in _members({m.__name__ for m in tops}):
        known = _remembered.get(name)
        if known is not None and known[0] is getattr(module, "__spec__", None):
            carried[name] = known[1]
    for top in tops:
        init = getattr(top, "__file__", "")
        if hasattr(top, "__path__") and init.endswith("__init__.py"):
            for member, file in _package_files(top.__name__, init).items():
                found = None if member in carried else _on_disk(file, file.endswith("__init__.py"))
                if found is not None:
                    carried[member] = found
    return carried
