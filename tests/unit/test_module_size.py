"""Every module is one job: one over 300 lines says in its docstring why it is long."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "air_magic"
#: Lines beyond which a module must say why it is long.
LIMIT = 300


def _long_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if len(p.read_text().splitlines()) > LIMIT)


def test_the_size_rule_sees_long_modules():
    """The package has modules over the limit, so the rule below reads something."""
    assert _long_modules()


@pytest.mark.parametrize("path", _long_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_long_module_says_why(path):
    """A module over 300 lines has a docstring sentence "Over 300 lines because ..." (or is split)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Over 300 lines because" in " ".join(doc.split()), f"{path.name}: split it, or say why it is long"
