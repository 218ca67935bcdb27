"""Which imported modules are the notebook's own code (they travel with a call) and which are installed."""

from __future__ import annotations

import importlib
import sys
import uuid

from air_magic import notebook_code


def _import_from(directory, name: str):
    (directory / f"{name}.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(directory))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(directory))


def test_a_module_beside_the_notebook_travels_and_one_in_an_install_directory_does_not(tmp_path):
    """A module in a plain directory is the notebook's; one in a directory holding distribution metadata (what
    `pip install --target` makes, put on PYTHONPATH), or inside such a directory (a package's vendored copy of
    another), is installed and is imported by name on the ranks."""
    own_dir, installed_dir = tmp_path / "notebook", tmp_path / "site"
    vendored_dir = installed_dir / "tool" / "_vendored" / "lib"
    own_dir.mkdir()
    vendored_dir.mkdir(parents=True)
    (installed_dir / "tool-1.0.dist-info").mkdir()
    own = _import_from(own_dir, f"helpers_{uuid.uuid4().hex[:8]}")
    installed = _import_from(installed_dir, f"lib_{uuid.uuid4().hex[:8]}")
    vendored = _import_from(vendored_dir, f"vendored_{uuid.uuid4().hex[:8]}")  # put on sys.path by its package
    try:
        found = {m.__name__ for m in notebook_code.notebook_modules()}
        assert own.__name__ in found
        assert installed.__name__ not in found
        assert vendored.__name__ not in found
    finally:
        for module in (own, installed, vendored):
            sys.modules.pop(module.__name__, None)
