"""The import cache of a warm supervisor: what it preloaded, when that no longer matches the caller, and the
hook modules' preparations.

A warm supervisor imports torch (and what AIR_MAGIC_PRELOAD names) once, so a forked
worker finds it imported. `Preloaded.stale_reason` says when that state no longer
matches a caller (another interpreter, a changed file, another copy on sys.path, an
import-time variable that differs): the supervisor then answers `stale` and the
launcher starts a fresh one. Preparations are what the hook modules of a call (see
JobRequest.hooks) do in `preload(env)` in the background, e.g. importing mlflow; what
they import is hidden from a forked worker until its code imports it (`_Unhide`,
`_Restore`). A preparation gives way to a request that arrives while it runs
(`_GiveWay`, `_roll_back`), unless the request only asks for preparations or is a call
whose ranks need it (the supervisor's inbox.py decides): a call whose code names
what a pending preparation brings (the hook's PRELOADS, e.g. "mlflow") has it finished
first (`needed_by`), so its ranks, and every later call's, find it done instead of
each importing it themselves.

Over 300 lines because the warm helper's cache and its staleness checks must agree line by line.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import mmap
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from .. import protocol as p
from ..boot import preload_modules

#: Variables read when torch is imported: a warm supervisor with other values is stale.
IMPORT_TIME_ENV = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONHASHSEED", "TORCH_HOME", "PYTORCH_NVML_BASED_CUDA_CHECK")
ExitFunc = tuple[Any, tuple[Any, ...], dict[str, Any]]
_BORN = time.monotonic()  # about when the helper started: it imports this module first thing


def log_timing(what: str, took: float) -> None:
    """One line of the helper's log (its stderr) saying how long `what` took and when, counted from the helper's start:
    where a first call's wait went."""
    print(
        f"air_magic supervisor {os.getpid()}: {what} after {took:.2f} s, {time.monotonic() - _BORN:.2f} s after the "
        "helper started",
        file=sys.stderr,
        flush=True,
    )


class Preloaded:
    """What a warm supervisor imported, and how to tell that it no longer matches the caller.

    Two kinds of preload. What AIR_MAGIC_PRELOAD (else PRELOAD) names is imported at start and
    is simply there in every forked worker. The hook modules of a call (LaunchJob.hooks; the MLflow
    tracking of a call names its in-rank hook) may define `preload(env)`, which the supervisor runs
    while it is idle, or before forking a call that needs it: what a preparation imports is kept out of a
    forked worker's sys.modules (and its atexit functions unregistered) until the worker's code imports it, so a
    worker carries only what its code imports, yet that import takes microseconds.
    """

    def __init__(self, warm: bool) -> None:
        self.modules: dict[str, str] = {}  # top-level package -> its directory, for the sys.path check
        self.files: dict[str, tuple[int, int]] = {}  # watched path -> (inode, mtime), see _watch
        self.env = {k: os.environ.get(k) for k in IMPORT_TIME_ENV}
        self.pending: dict[str, dict[str, str]] = {}  # hook module -> environment of the call that asked
        self.running: str | None = None  # the hook module whose preparation runs now
        self.hidden_tops: set[str] = set()  # top-level names that preparations brought in
        self.exit_funcs: list[ExitFunc] = []
        if not warm:
            return
        for name in preload_modules():
            if importlib.util.find_spec(name.split(".")[0]) is None:
                continue
            module = __import__(name)
            self.modules[name.split(".")[0]] = os.path.dirname(getattr(module, "__file__", "") or "")
        self._watch(list(sys.modules.values()))

    def _watch(self, modules: list[Any]) -> None:
        """Remember how the files behind `modules` look now, cheaply enough to check on every launch.

        A module in a site-packages directory is watched through its top-level entry there (the
        package directory, or the module file): installing, upgrading or removing a distribution
        adds and removes entries in it, which changes its inode or mtime. Every other file (the
        user's own packages, editable installs) is watched itself, so an edit in place is seen.
        A few hundred stats instead of one per module: mlflow alone loads over a thousand.
        """
        stdlib = sysconfig.get_paths()["stdlib"]
        for module in modules:
            path = getattr(module, "__file__", None)
            if not path or path.startswith(stdlib):
                continue
            for marker in ("/site-packages/", "/dist-packages/"):
                cut = path.rfind(marker)
                if cut >= 0:
                    root = cut + len(marker)
                    path = path[:root] + path[root:].split("/", 1)[0]
                    break
            if path not in self.files:
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                self.files[path] = (info.st_ino, info.st_mtime_ns)

    def stale_reason(self, msg: p.LaunchJob) -> str | None:
        if msg.executable != sys.executable:
            return f"the interpreter is now {msg.executable}"
        env = msg.env
        for key, value in self.env.items():
            if env.get(key) != value:
                return f"{key} changed"
        for top, where in self.modules.items():
            spec = importlib.machinery.PathFinder.find_spec(top, msg.sys_path)
            if spec is not None and spec.origin and os.path.dirname(spec.origin) != where:
                return f"sys.path now finds {top} at {spec.origin}"
        for path, seen in self.files.items():
            try:
                info = os.stat(path)
            except OSError:
                return f"{path} is gone"
            if (info.st_ino, info.st_mtime_ns) != seen:
                return f"{path} changed on disk"
        return None

    # -- preparations: imports a call asked for, done in the background ------------
    def ask(self, hooks: list[str], env: dict[str, str]) -> None:
        """Note hook modules whose preparations run later (`run_preparations`): a call's, or a PrepareHooks'."""
        for name in hooks:
            self.pending[name] = env

    def needed_by(self, payload: Path) -> list[str]:
        """The pending (or running) hook modules whose PRELOADS the call's payload names: its ranks would import
        them.

        The payload holds the names the call's code uses (a cell's source; a function's, and those of the
        notebook's own modules, which travel by value): finding "mlflow" there means a rank imports it. Code
        in an installed package is pickled by name, so what it imports is not seen: its ranks import it
        themselves, as without a preparation.
        """
        names: dict[bytes, list[str]] = {}
        for hook in {*self.pending, *filter(None, [self.running])}:
            try:
                module = importlib.import_module(hook)  # air_magic's own hook module: small, imports no package
            except Exception:  # noqa: BLE001, S112 - run_preparations reports it
                continue
            for package in getattr(module, "PRELOADS", ()):
                names.setdefault(package.encode(), []).append(hook)
        if not names:
            return []
        try:
            with open(payload, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return sorted({h for name, hooks in names.items() if _names(data, name) for h in hooks})
        except (OSError, ValueError):  # no payload (an empty file cannot be mapped): nothing is needed
            return []

    def run_preparations(
        self, waiting: Callable[[str], bool] = lambda _: False, only: Collection[str] | None = None
    ) -> bool:
        """Run the pending preparations (those named in `only`, if given), each catching its own failure (the
        workers then import for themselves).

        Gives way to requests: while a preparation imports, `waiting(hook module)` is asked at each module it
        loads, and once it says a request must be served first, the preparation is interrupted there
        (`_GiveWay`), what it was loading is forgotten (`_roll_back`), and it stays pending for the next idle
        moment. Returns False then, True once nothing asked for is pending. Threads are no way out: the
        supervisor forks, and a thread caught importing at fork time leaves its import locks held in the child.
        """
        import atexit

        register = atexit.register
        registered: list[ExitFunc] = []

        def record(func: Any, *args: Any, **kwargs: Any) -> Any:
            registered.append((func, args, kwargs))
            return register(func, *args, **kwargs)

        for name in [n for n in list(self.pending) if only is None or n in only]:
            env = self.pending.pop(name)
            started = time.monotonic()
            start = before = set(sys.modules)
            registered.clear()
            give_way = _GiveWay(functools.partial(waiting, name), start)
            packages: list[str] = []
            sys.meta_path.insert(0, give_way)
            atexit.register = record  # type: ignore[assignment]
            self.running = name
            try:
                module = importlib.import_module(name)
                before = set(sys.modules)  # the hook module itself is air_magic's: never hidden
                preload = getattr(module, "preload", None)
                if preload is not None:
                    packages = list(preload(env) or ())
            except PreparationInterrupted:
                pass
            except Exception as exc:  # noqa: BLE001 - a preparation is an optimisation; say why it did not happen
                if give_way.kept is None:
                    print(f"air_magic supervisor: preparation {name} failed: {exc!r}", file=sys.stderr, flush=True)
            finally:
                self.running = None
                atexit.register = register
                sys.meta_path.remove(give_way)
            for func, _, _ in registered:
                atexit.unregister(func)  # they belong to a worker that imports the package, not to us
            if give_way.kept is not None:
                _roll_back(start, give_way.kept)
                registered[:] = [e for e in registered if _module_of(e[0]) in sys.modules]
                packages = []
            self.exit_funcs += list(registered)
            added = [sys.modules[n] for n in sys.modules.keys() - before]
            tops = {n.partition(".")[0] for n in sys.modules.keys() - before}
            self.hidden_tops |= {t for t in tops if t not in before and t not in sys.stdlib_module_names}
            for package in packages:
                loaded = sys.modules.get(package)
                if loaded is not None and package not in self.modules:
                    self.modules[package] = os.path.dirname(getattr(loaded, "__file__", "") or "")
            self._watch(added)
            took = time.monotonic() - started
            how = "gave way to a request" if give_way.kept is not None else "done"
            log_timing(f"preparation {name} ({_store_of(env)}) {how}", took)
            if give_way.kept is not None:
                self.pending.setdefault(name, env)  # a call that asked meanwhile sets its own environment
                return False
        return True

    def hide_in_child(self) -> None:
        """In a forked worker: take what preparations imported out of sys.modules until the worker imports it."""
        if not self.hidden_tops:
            return
        groups: dict[str, dict[str, Any]] = {}
        for name in list(sys.modules):
            top = name.partition(".")[0]
            if top in self.hidden_tops:
                groups.setdefault(top, {})[name] = sys.modules.pop(name)
        if groups:
            sys.meta_path.insert(0, _Unhide(groups, self.exit_funcs))


class _Unhide(importlib.abc.MetaPathFinder):
    """In a forked worker, gives back a hidden package (with its submodules) when it is imported.

    The module objects are the supervisor's, already executed: the import costs a dict update.
    `importlib.util.find_spec` alone finds the package without bringing it back.
    """

    def __init__(self, groups: dict[str, dict[str, Any]], exit_funcs: list[ExitFunc]) -> None:
        self.groups = groups
        self.exit_funcs = exit_funcs

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        group = self.groups.get(name.partition(".")[0])
        module = None if group is None else group.get(name)
        if module is None:
            return None
        return importlib.util.spec_from_loader(
            name,
            _Restore(self, module),
            origin=getattr(getattr(module, "__spec__", None), "origin", None),
            is_package=hasattr(module, "__path__"),
        )

    def restore(self, top: str) -> None:
        group = self.groups.pop(top, None)
        if group is None:
            return
        sys.modules.update(group)
        for func, args, kwargs in self.exit_funcs:
            if (getattr(func, "__module__", None) or "").partition(".")[0] == top:
                import atexit

                atexit.register(func, *args, **kwargs)
        if not self.groups and self in sys.meta_path:
            sys.meta_path.remove(self)


class _Restore(importlib.abc.Loader):
    """Loader of one hidden module: hands back the supervisor's module object, executes nothing."""

    def __init__(self, finder: _Unhide, module: Any) -> None:
        self.finder = finder
        self.module = module
        self.spec = getattr(module, "__spec__", None)

    def create_module(self, spec: Any) -> Any:
        self.finder.restore(spec.name.partition(".")[0])
        return self.module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self.spec  # the import system set ours; keep the package's own


class PreparationInterrupted(BaseException):
    """Raised inside a preparation at its next import once a request waits; a BaseException, so that code
    guarding an optional import with `except ImportError` or `except Exception` lets it through."""


class _GiveWay(importlib.abc.MetaPathFinder):
    """First on sys.meta_path during a preparation: at each module to load, asks `waiting()`; once it says yes,
    raises PreparationInterrupted there and at every later import, so the preparation unwinds whatever catches it.

    It fires only at an import made by a module's own code (`_by_module_code`), and only where what it would
    drop holds no extension module (one loaded twice keeps the objects of its first load). When it fires it
    notes, in `kept`, the modules the preparation finished before the first one it was still loading: those
    finished before that one started, so they hold nothing of what is rolled back.
    """

    def __init__(self, waiting: Callable[[], bool], before: set[str]) -> None:
        self.waiting = waiting
        self.before = before
        self.kept: set[str] | None = None

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if self.kept is None:
            if not (_by_module_code() and self.waiting()):
                return None
            kept: set[str] = set()
            dropped: list[Any] = []
            for loaded, module in list(sys.modules.items()):  # in the order they started loading
                if loaded in self.before:
                    continue
                if dropped or getattr(getattr(module, "__spec__", None), "_initializing", False):
                    dropped.append(module)
                else:
                    kept.add(loaded)
            if any(_is_extension(m) for m in dropped if m.__name__.partition(".")[0] not in sys.stdlib_module_names):
                return None  # an extension module cannot be loaded twice: go on until it is kept
            self.kept = kept
        raise PreparationInterrupted(name)


def _names(data: mmap.mmap, name: bytes) -> bool:
    """Whether `data` holds `name` as a whole name (`mlflow`, `mlflow.log_metric`; not `mlflow_utils`).

    `find` (memchr-fast: a large payload costs milliseconds) and a look at the bytes on either side."""
    at = data.find(name)
    while at >= 0:
        end = at + len(name)
        if not (_is_name_byte(data[at - 1 : at]) or _is_name_byte(data[end : end + 1])):
            return True
        at = data.find(name, at + 1)
    return False


def _is_name_byte(byte: bytes) -> bool:
    return byte.isalnum() or byte == b"_"


def _is_extension(module: Any) -> bool:
    return str(getattr(module, "__file__", None) or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _by_module_code() -> bool:
    """Whether the import being found was asked by a module's own code, not by a function.

    Only there may a preparation be interrupted: a module that fails while it loads is dropped whole, but a
    function interrupted at a lazy import may leave its library half set up (SQLAlchemy's caches, say).
    """
    frame: Any = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        if isinstance(frame.f_locals.get("self"), importlib.machinery.ExtensionFileLoader):
            return False  # asked by an extension module's initialisation
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "<module>"


def _roll_back(before: set[str], kept: set[str]) -> None:
    """Forget what an interrupted preparation loaded, except what `kept` names and finished standard modules.

    A module is also forgotten when its parent package is (the import system dropped those still loading):
    loaded again later, it is bound to the new package like any fresh import.
    """
    for name in sorted(sys.modules.keys() - before):  # a package sorts before its submodules
        parent = name.rpartition(".")[0]
        keep = name in kept or name.partition(".")[0] in sys.stdlib_module_names
        if not keep or (parent and parent not in sys.modules):
            del sys.modules[name]


def _store_of(env: dict[str, str]) -> str:
    """For the helper log: what a preparation was asked for (its tracking store, or the import alone)."""
    uri = env.get("MLFLOW_TRACKING_URI")
    return f"for {uri.partition(':')[0]} store" if uri else "imports"


def _module_of(func: Any) -> str:
    return getattr(func, "__module__", None) or ""
