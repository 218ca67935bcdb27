"""Test modules have unique names: the suite has no __init__.py files, so two modules of one name (tests/test_x.py
and tests/unit/test_x.py) make pytest refuse to collect the second ("import file mismatch")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_name():
    """Every test_*.py under tests/ has a name of its own."""
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert names["test_module_names.py"] == 1
    assert [name for name, count in names.items() if count > 1] == []
