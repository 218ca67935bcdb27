"""Every module is one job: one over 300 lines says in its docstring why it is long, and none is over 400."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "air_magic"
#: Lines beyond which a module must say why it is long.
LIMIT = 300
#: Lines no module may pass, whatever its docstring says: split it along a seam.
CAP = 400


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _long_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if _lines(p) > LIMIT)


def test_the_size_rule_sees_long_modules():
    """The package has modules over the limit, so the rule below reads something."""
    assert _long_modules()


@pytest.mark.parametrize("path", _long_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_long_module_says_why(path):
    """A module over 300 lines has a docstring sentence "Over 300 lines because ..." (or is split)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Over 300 lines because" in " ".join(doc.split()), f"{path.name}: split it, or say why it is long"


@pytest.mark.parametrize("path", _long_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_the_cap(path):
    """A module over 400 lines fails whatever its docstring says: it does more than one job."""
    assert _lines(path) <= CAP, f"{path.name}: {_lines(path)} lines; split it along a seam (at most {CAP})"


def test_the_cap_reads_what_a_module_holds(tmp_path):
    """The count is the module's lines, so a module one line over the cap is seen."""
    module = tmp_path / "long.py"
    module.write_text('"""Over 300 lines because it is long."""\n' + "x = 1\n" * CAP)
    assert _lines(module) == CAP + 1 > CAP
