"""The notebook's own modules on a rank: their code travels with every call, and a finder serves it by name.

A payload (the bytes payload.serialize makes and the rank reads) is two
pickles, one after the other: first a plain pickle of `Carried`, the code of
every module the notebook imported from its own files (a `helpers.py` beside
the notebook, a package folder on a `sys.path` entry outside site-packages),
keyed by module name; then the cloudpickled call. `load_call` reads the
first, puts a finder first on `sys.meta_path` that serves those names from
that code, and only then unpickles the call. So `import helpers` on a rank,
wherever it happens (inside the function, the cell, another such module, or
while the call itself is unpickled) gets the notebook's copy, never a file of
the same name on the node, and works on a node that has no such file.

A hot rank keeps what it imported between calls: when the code of any carried
module changed (the notebook edited and reloaded it), every module the finder
served before, and any module of a carried name that came from elsewhere, is
dropped from `sys.modules`, so the next `import` runs the new code.

This module runs on both sides of the process boundary and imports nothing
of air_magic's. It does not decide which modules travel (payload.py does).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import io
import linecache
import os
import pickle
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Module:
    """One carried module: its code as the notebook has it, and where it lives in the notebook's filesystem."""

    #: The file the notebook imported it from (the module's `__file__` on the rank too).
    file: str
    #: `__init__.py` of a package: its submodules are looked up beside it as well.
    package: bool
    #: The source, as bytes (its encoding declaration, if any, is honoured).
    data: bytes
    #: Digest of `data`: a hot rank replaces its copy when this changes.
    digest: str


#: Module name -> its carried code.
Carried = dict[str, Module]


def pack(carried: Carried, call_blob: bytes) -> bytes:
    """The payload: the carried modules, then the cloudpickled call."""
    head = pickle.dumps({name: (m.file, m.package, m.data, m.digest) for name, m in carried.items()})
    return head + call_blob


def load_call(blob: bytes) -> Any:
    """Serve the payload's carried modules by name in this process, then unpickle and return its call."""
    import cloudpickle  # noqa: F401 - the call's pickle needs it importable

    stream = io.BytesIO(blob)
    head = pickle.Unpickler(stream).load()
    install({name: Module(*fields) for name, fields in head.items()})
    return pickle.load(stream)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the carried modules by name; first on `sys.meta_path` while a rank runs."""

    def __init__(self) -> None:
        self.modules: Carried = {}

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        module = self.modules.get(fullname)
        if module is None:
            return None
        spec = importlib.util.spec_from_loader(fullname, self, origin=module.file, is_package=module.package)
        assert spec is not None
        spec.has_location = True  # __file__ is the notebook's path: code that looks beside itself looks there
        if module.package:
            spec.submodule_search_locations = [os.path.dirname(module.file)]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        carried = self.modules[module.__name__]
        code = compile(carried.data, carried.file, "exec", dont_inherit=True)
        text = importlib.util.decode_source(carried.data)
        lines = text.splitlines(keepends=True)
        linecache.cache[carried.file] = (len(text), None, lines, carried.file)  # tracebacks show these lines
        exec(code, module.__dict__)  # noqa: S102 - running the module is the point

    def get_source(self, fullname: str) -> str | None:
        carried = self.modules.get(fullname)
        if carried is None:
            return None
        return importlib.util.decode_source(carried.data)


_finder = _Finder()


def install(carried: Carried) -> None:
    """Serve `carried` by name from now on; drop what this process imported of an older copy."""
    old = _finder.modules
    changed = old.keys() != carried.keys() or any(old[n].digest != m.digest for n, m in carried.items())
    if changed:  # modules may import each other: every one of an older copy goes, not only the changed ones
        roots = {name.split(".")[0] for name in (*old, *carried)}
        for name in list(sys.modules):
            if name.split(".")[0] in roots:
                del sys.modules[name]
        importlib.invalidate_caches()
    _finder.modules = dict(carried)
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    sys.meta_path.insert(0, _finder)
