"""payload.serialize: modules the notebook imported from its own files travel by value; installed ones by name."""

from __future__ import annotations

import importlib
import sys
import uuid

import cloudpickle
import pytest

from air_magic import payload
from air_magic.launch.rank import carried
from air_magic.launch.rank.carried import load_call


@pytest.fixture(autouse=True)
def no_finder_left():
    """The carried modules' finder that load_call installs here (as on a rank) is gone after each test."""
    yield
    if carried._finder in sys.meta_path:
        sys.meta_path.remove(carried._finder)
    for name in carried._finder.modules:
        sys.modules.pop(name, None)
    carried._finder.modules = {}


def _import_from(tmp_path, source: str):
    name = f"nbhelpers_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_a_module_beside_the_notebook_travels_by_value_even_once_its_file_is_gone(tmp_path):
    """A function using a module imported from a plain directory still runs its imported code after the file is
    removed and the module forgotten, as on a node without the file."""
    helpers = _import_from(tmp_path, "def version():\n    return 'the notebook copy'\n")

    def call():
        return helpers.version()

    blob = payload.serialize(call, (), {})
    (tmp_path / f"{helpers.__name__}.py").write_text("def version():\n    return 'another copy'\n")
    del sys.modules[helpers.__name__]
    target, args, kwargs, _ = load_call(blob)
    assert target(*args, **kwargs) == "the notebook copy"


def test_installed_and_standard_modules_stay_by_name_and_registrations_are_undone(tmp_path):
    """Only the notebook's own module is chosen; cloudpickle's by-value registry is as it was after serialize."""
    helpers = _import_from(tmp_path, "X = 1\n")
    chosen = {m.__name__ for m in payload.notebook_modules()}
    assert helpers.__name__ in chosen
    assert not chosen & {"json", "os", "cloudpickle", "pytest", "air_magic"}
    before = set(cloudpickle.list_registry_pickle_by_value())
    payload.serialize(lambda: helpers.X, (), {})
    assert set(cloudpickle.list_registry_pickle_by_value()) == before
    del sys.modules[helpers.__name__]


def test_a_notebook_module_that_cannot_travel_by_value_is_sent_by_name(tmp_path):
    """A module holding something unpicklable (a lock) does not make the call fail: it is imported by name."""
    helpers = _import_from(tmp_path, "import threading\nLOCK = threading.Lock()\ndef f():\n    return 7\n")

    def call():
        return helpers.f()

    blob = payload.serialize(call, (), {})
    target, _, _, _ = load_call(blob)
    assert target() == 7
    del sys.modules[helpers.__name__]


def test_a_module_imported_by_name_inside_the_function_is_the_notebooks_copy_once_its_file_is_gone(tmp_path):
    """`import helpers` inside the function, after the file was deleted and the module forgotten, imports the code
    the notebook imported; the rank's traceback lines come from it too."""
    helpers = _import_from(tmp_path, "def version():\n    return 'the notebook copy'\n")
    name = helpers.__name__

    def call():
        return importlib.import_module(name).version()

    blob = payload.serialize(call, (), {})
    (tmp_path / f"{name}.py").unlink()
    del sys.modules[name]
    target, args, kwargs, _ = load_call(blob)
    assert target(*args, **kwargs) == "the notebook copy"
    assert sys.modules[name].__file__ == str(tmp_path / f"{name}.py")


def test_the_copy_imported_stays_until_a_reload_and_a_rank_replaces_a_changed_one(tmp_path):
    """A file edited but not reloaded still travels as imported; after importlib.reload the new code travels, and a
    process that imported the old copy (a hot rank) imports the new one; an unchanged copy is not imported again."""
    helpers = _import_from(tmp_path, "VALUE = 1\n")
    name = helpers.__name__
    sys.path.insert(0, str(tmp_path))  # reload finds the file where it was imported from
    try:

        def call():
            return importlib.import_module(name).VALUE

        imported = payload.serialize(call, (), {})
        (tmp_path / f"{name}.py").write_text("VALUE = 2\n")
        edited = payload.serialize(call, (), {})
        importlib.reload(helpers)
        reloaded = payload.serialize(call, (), {})
        del sys.modules[name]  # from here on this process plays a hot rank
        assert load_call(imported)[0]() == 1
        kept = sys.modules[name]
        assert load_call(edited)[0]() == 1 and sys.modules[name] is kept
        assert load_call(reloaded)[0]() == 2 and sys.modules[name] is not kept
    finally:
        sys.path.remove(str(tmp_path))


def test_a_package_of_the_notebook_carries_its_submodules_the_notebook_did_not_import(tmp_path):
    """A package folder on the notebook's sys.path: a submodule the notebook never imported is served on the rank."""
    pkg = tmp_path / f"nbpkg_{uuid.uuid4().hex[:8]}"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "deep.py").write_text("WHERE = 'deep'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module(pkg.name)
    finally:
        sys.path.remove(str(tmp_path))
    blob = payload.serialize(lambda: importlib.import_module(f"{pkg.name}.sub.deep").WHERE, (), {})
    for name in [n for n in sys.modules if n.startswith(pkg.name)]:
        del sys.modules[name]
    (pkg / "sub" / "deep.py").unlink()
    assert load_call(blob)[0]() == "deep"
