"""A warm supervisor's import cache: when it no longer matches a caller, and how warm-ups stay hidden from workers."""

from __future__ import annotations

import os
import sys
import time

import pytest

from air_magic.launch.local.preload import IMPORT_TIME_ENV, Preloaded
from air_magic.launch.protocol import LaunchJob


def _msg(**kw) -> LaunchJob:
    base = {
        "job": "j",
        "world_size": 1,
        "fork": True,
        "executable": sys.executable,
        "sys_path": list(sys.path),
        "run_dir": "",
        "env": dict(os.environ),
        "package_parent": "",
    }
    return LaunchJob(**{**base, **kw})


def _package(root, name: str, body: str = "") -> str:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(body)
    return str(root / name)


def test_a_matching_caller_is_not_stale():
    """The same interpreter, environment and sys.path: the warm state is used."""
    assert Preloaded(warm=False).stale_reason(_msg()) is None


def test_another_interpreter_is_stale():
    """A kernel now running another Python gets fresh workers."""
    assert "interpreter" in (Preloaded(warm=False).stale_reason(_msg(executable="/other/python")) or "")


def test_an_import_time_variable_that_differs_is_stale():
    """A variable read when torch is imported, set differently by the caller, makes the warm state stale."""
    key = IMPORT_TIME_ENV[0]
    env = dict(os.environ, **{key: (os.environ.get(key) or "") + ":/changed"})
    assert Preloaded(warm=False).stale_reason(_msg(env=env)) == f"{key} changed"


def test_another_copy_on_sys_path_is_stale(tmp_path):
    """A caller whose sys.path finds a preloaded package elsewhere would import another copy: stale."""
    first = _package(tmp_path / "one", "cachedpkg")
    _package(tmp_path / "two", "cachedpkg")
    watched = Preloaded(warm=False)
    watched.modules["cachedpkg"] = first
    assert watched.stale_reason(_msg(sys_path=[str(tmp_path / "one")])) is None
    reason = watched.stale_reason(_msg(sys_path=[str(tmp_path / "two"), str(tmp_path / "one")]))
    assert reason is not None and "sys.path now finds cachedpkg" in reason and str(tmp_path / "two") in reason


def test_a_watched_file_edited_or_removed_is_stale(tmp_path, monkeypatch):
    """The user's own module edited in place, or deleted, after it was preloaded."""
    (tmp_path / "ownmod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import ownmod  # type: ignore[import-not-found]

    try:
        watched = Preloaded(warm=False)
        watched._watch([ownmod])
        assert watched.stale_reason(_msg()) is None
        time.sleep(0.01)
        (tmp_path / "ownmod.py").write_text("X = 2\n")
        assert "ownmod.py changed on disk" in (watched.stale_reason(_msg()) or "")
        watched = Preloaded(warm=False)
        watched._watch([ownmod])
        (tmp_path / "ownmod.py").unlink()
        assert "ownmod.py is gone" in (watched.stale_reason(_msg()) or "")
    finally:
        sys.modules.pop("ownmod", None)


@pytest.fixture
def hook(tmp_path, monkeypatch):
    """A hook module whose preload imports a package of its own (registering an exit function), and one without."""
    _package(tmp_path, "warmedpkg", "import atexit\nLOADED = True\natexit.register(len, ())\n")
    (tmp_path / "warmhook.py").write_text(
        "def preload(env):\n    import warmedpkg\n    warmedpkg.ENV = env\n    return ['warmedpkg']\n"
    )
    (tmp_path / "coldhook.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("warmedpkg", "warmhook", "coldhook"):
        sys.modules.pop(name, None)


def test_a_hooks_warm_up_runs_when_asked_and_what_it_imports_is_watched(hook):
    """The hook modules of a call are warmed up later, with the call's environment; a hook without preload is
    skipped."""
    preloaded = Preloaded(warm=False)
    preloaded.ask(["warmhook", "coldhook"], {"MLFLOW_TRACKING_URI": "sqlite:///x.db"})
    assert "warmedpkg" not in sys.modules, "asking runs nothing yet"
    preloaded.run_preparations()
    assert not preloaded.pending
    assert sys.modules["warmedpkg"].ENV == {"MLFLOW_TRACKING_URI": "sqlite:///x.db"}
    assert preloaded.hidden_tops == {"warmedpkg"}
    assert "warmedpkg" in preloaded.modules, "the package it returned is checked against the caller's sys.path"
    assert any(path.endswith("warmedpkg/__init__.py") for path in preloaded.files)


def test_what_a_warm_up_imported_is_hidden_until_imported_again(hook):
    """In a forked worker the warmed package is out of sys.modules until the worker imports it: then the same module."""
    preloaded = Preloaded(warm=False)
    preloaded.ask(["warmhook"], {})
    preloaded.run_preparations()
    warmed = sys.modules["warmedpkg"]
    meta_path = list(sys.meta_path)
    try:
        preloaded.hide_in_child()
        assert "warmedpkg" not in sys.modules
        import warmedpkg  # type: ignore[import-not-found]

        assert warmedpkg is warmed and warmedpkg.LOADED, "given back, not executed again"
        assert sys.meta_path == meta_path, "the finder leaves once nothing is hidden"
    finally:
        sys.meta_path[:] = meta_path


@pytest.fixture
def slow_hook(tmp_path, monkeypatch):
    """A hook whose preload imports a small package, then one of several submodules, one of which swallows every
    exception around an import."""
    _package(tmp_path, "earlypkg", "LOADED = True\n")
    _package(tmp_path, "latepkg", "from . import a\nfrom . import greedy\nfrom . import b\n")
    (tmp_path / "latepkg" / "a.py").write_text("import atexit\ndef bye():\n    pass\natexit.register(bye)\nA = 1\n")
    (tmp_path / "latepkg" / "greedy.py").write_text(
        "try:\n    from . import optional\nexcept BaseException:\n    optional = None\nfrom . import c\n"
    )
    for name in ("optional", "b", "c"):
        (tmp_path / "latepkg" / f"{name}.py").write_text(f"{name.upper()} = 1\n")
    (tmp_path / "slowhook.py").write_text(
        "def preload(env):\n    import earlypkg\n    import latepkg\n    return ['earlypkg', 'latepkg']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n.partition(".")[0] in ("earlypkg", "latepkg", "slowhook")]:
        sys.modules.pop(name)


def _waiting_after(asks: int):
    """A `waiting` that says a request waits from its `asks`-th question on."""
    count = iter(range(1, 1000))
    return lambda hook: next(count) >= asks


@pytest.mark.parametrize("asks", [1, 2, 3], ids=["at a submodule", "after one", "inside a catch-all"])
def test_a_warm_up_gives_way_to_a_request_forgets_what_it_was_loading_and_runs_again(slow_hook, asks):
    """Interrupted at an import, a warm-up keeps the packages it finished, drops every module of the one it was
    loading (even past code that catches the interruption), stays pending, and completes at the next try."""
    import atexit

    preloaded = Preloaded(warm=False)
    preloaded.ask(["slowhook"], {"K": "v"})
    assert preloaded.run_preparations(_waiting_after(asks)) is False
    assert "earlypkg" in sys.modules and preloaded.hidden_tops == {"earlypkg"}
    assert not [n for n in sys.modules if n.partition(".")[0] == "latepkg"], "latepkg was half loaded: all of it goes"
    assert preloaded.pending == {"slowhook": {"K": "v"}}
    assert preloaded.exit_funcs == [], "an exit function of a forgotten module is not kept for the workers"
    assert atexit.register.__module__ == "atexit"
    assert preloaded.run_preparations() is True
    import latepkg  # type: ignore[import-not-found]

    assert (latepkg.a.A, latepkg.b.B, latepkg.c.C, latepkg.greedy.optional.OPTIONAL) == (1, 1, 1, 1)
    assert preloaded.hidden_tops == {"earlypkg", "latepkg"} and not preloaded.pending
    assert [f for f, _, _ in preloaded.exit_funcs] == [latepkg.a.bye]


def test_a_warm_up_with_no_request_waiting_runs_through(slow_hook):
    """`waiting` saying no at every import: the warm-up completes in one go."""
    preloaded = Preloaded(warm=False)
    preloaded.ask(["slowhook"], {})
    assert preloaded.run_preparations(lambda hook: False) is True
    assert "latepkg.c" in sys.modules and not preloaded.pending


def test_an_import_made_by_a_function_is_never_interrupted(slow_hook):
    """With a request always waiting, the imports the warm-up function makes itself still run; the first one made
    by a module's code gives way (a function stopped mid-way could leave its library half set up)."""
    preloaded = Preloaded(warm=False)
    preloaded.ask(["slowhook"], {})
    assert preloaded.run_preparations(lambda hook: True) is False
    assert "earlypkg" in sys.modules and "latepkg" not in sys.modules


def test_a_warm_up_does_not_give_way_where_it_would_drop_an_extension_module(tmp_path, monkeypatch):
    """Once the package being loaded holds an extension module (which cannot be loaded twice), the warm-up does not
    stop inside it; it gives way again at the next package."""
    import importlib.machinery

    _package(tmp_path, "extpkg", "from . import fakeext\nfrom . import after\n")
    (tmp_path / "extpkg" / "fakeext.py").write_text(
        f"__file__ = __file__[:-3] + {importlib.machinery.EXTENSION_SUFFIXES[0]!r}\n"
    )
    (tmp_path / "extpkg" / "after.py").write_text("")
    _package(tmp_path, "purepkg", "from . import inner\n")
    (tmp_path / "purepkg" / "inner.py").write_text("")
    (tmp_path / "exthook.py").write_text("def preload(env):\n    import extpkg\n    import purepkg\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    preloaded = Preloaded(warm=False)
    preloaded.ask(["exthook"], {})
    try:
        assert preloaded.run_preparations(_waiting_after(2)) is False  # a request from the import of extpkg.after on
        assert "extpkg.after" in sys.modules and "purepkg" not in sys.modules
    finally:
        for name in [n for n in sys.modules if n.partition(".")[0] in ("extpkg", "purepkg", "exthook")]:
            sys.modules.pop(name)


def test_site_packages_are_watched_by_their_top_level_entry(tmp_path, monkeypatch):
    """An installed package is seen as changed when an upgrade replaces its files; the user's own files when edited."""
    from air_magic.launch.local.preload import Preloaded
    from air_magic.launch.protocol import LaunchJob

    site = tmp_path / "lib" / "site-packages"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("from . import sub\n")
    (site / "fakepkg" / "sub.py").write_text("X = 1\n")
    own = tmp_path / "own"
    own.mkdir()
    (own / "mine.py").write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(own))
    monkeypatch.syspath_prepend(str(site))
    import fakepkg  # type: ignore[import-not-found]
    import mine  # type: ignore[import-not-found]

    try:
        watched = Preloaded(warm=False)
        watched._watch([fakepkg, fakepkg.sub, mine])
        assert set(watched.files) == {str(own / "mine.py"), str(site / "fakepkg")}, "one entry per installed package"
        msg = LaunchJob(
            job="j",
            world_size=1,
            fork=True,
            executable=sys.executable,
            sys_path=sys.path,
            run_dir="",
            env=dict(os.environ),
            package_parent="",
        )
        assert watched.stale_reason(msg) is None
        (site / "fakepkg" / "__init__.py").unlink()  # what pip does on upgrade: old files out, new files in
        (site / "fakepkg" / "__init__.py").write_text("from . import sub\nNEW = 1\n")
        assert "fakepkg changed on disk" in (watched.stale_reason(msg) or "")
        watched = Preloaded(warm=False)
        watched._watch([mine])
        time.sleep(0.01)
        (own / "mine.py").write_text("Y = 2\n")
        assert "mine.py changed on disk" in (watched.stale_reason(msg) or "")
    finally:
        for name in ("fakepkg", "fakepkg.sub", "mine"):
            sys.modules.pop(name, None)
