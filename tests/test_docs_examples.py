"""The quickstart examples of README.md and the documentation run as written, in a real kernel (2 CPU ranks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def code_blocks(path: Path, after: str) -> list[str]:
    """The fenced code blocks of a Markdown file that come after the line `after`, up to the next `## ` heading."""
    text = path.read_text()
    start = text.index(after + "\n")
    end = text.find("\n## ", start + len(after))
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"^```[a-z]*\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)


def test_readme_quickstart(kernel):
    """README.md's quickstart trains on every rank and returns one loss per rank."""
    (code,) = code_blocks(ROOT / "README.md", "## Quickstart")
    kernel.execute(code, timeout=300).check()
    losses = kernel.value("losses")
    assert re.fullmatch(r"\[[0-9.]+, [0-9.]+\]", losses), losses


def test_docs_quickstart(kernel):
    """docs/quickstart.md's function and its cell run as written."""
    function, cell = code_blocks(ROOT / "docs" / "quickstart.md", "# Quickstart")
    kernel.execute(function, timeout=300).check()
    assert re.fullmatch(r"\[[0-9.]+, [0-9.]+\]", kernel.value("losses"))
    kernel.execute(cell, timeout=300).check()
    assert kernel.value("ranks") == "[0, 1]"


def test_magic_page_example(kernel):
    """The first example of docs/magic.md runs and stores its per-rank result under --out."""
    cell = code_blocks(ROOT / "docs" / "magic.md", "# The `%%distributed` cell magic")[1]
    kernel.execute(cell, timeout=300).check()
    assert kernel.value("ranks") == "[0, 1]"
