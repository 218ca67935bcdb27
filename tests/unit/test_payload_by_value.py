"""payload.serialize: modules the notebook imported from its own files travel by value; installed ones by name."""

from __future__ import annotations

import importlib
import sys
import uuid

import cloudpickle

from air_magic import payload


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
    target, args, kwargs, _ = cloudpickle.loads(blob)
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
    target, _, _, _ = cloudpickle.loads(blob)
    assert target() == 7
    del sys.modules[helpers.__name__]
