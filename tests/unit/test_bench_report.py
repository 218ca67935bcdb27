"""bench/README.md is what bench/report.py writes from bench/results/, so its tables cannot go stale."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_report", module)
    spec.loader.exec_module(module)
    return module


def test_readme_is_generated() -> None:
    """bench/README.md equals what bench/report.py renders now (run `python bench/report.py` to refresh it)."""
    assert (ROOT / "bench" / "README.md").read_text() == report().render()


def test_every_result_file_is_reported() -> None:
    """Every file in bench/results/ is named in bench/README.md: a new result cannot be left out silently."""
    text = report().render()
    names = [p.name for p in sorted((ROOT / "bench" / "results").iterdir())]
    missing = [n for n in names if f"| `{n}` |" not in text and f"`results/{n}`" not in text]
    assert missing == []


def test_every_script_is_listed() -> None:
    """Every benchmark script appears in the README's table of scripts, with its docstring's first line."""
    text = report().render()
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name != "report.py":
            assert f"| `{path.name}` |" in text
