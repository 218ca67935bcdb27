"""No air_magic module imports, directly or through others, a module that imports it back (lazy imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path, package: str) -> set[str]:
    """Every air_magic module `path` imports, at module level or inside functions."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
        base = module
    else:
        base = module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package)}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                root = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{root}.{node.module}" if node.module else root
            else:
                target = node.module or ""
            if not target.startswith(package):
                continue
            for alias in node.names:  # `from . import runner` imports a module; `from .job import JobSpec` a name
                sub = f"{target}.{alias.name}"
                found.add(sub if _module_path(sub) is not None else target)
    return {m for m in found if _module_path(m) is not None and m != module}


def _module_path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def test_the_package_has_no_import_cycle():
    """No air_magic module imports, directly or through others, a module that imports it back (lazy imports
    included)."""
    graph = {}
    for path in (ROOT / "air_magic").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _imports(path, "air_magic")
    assert "air_magic.launch.local" in graph and "air_magic.errors" in graph["air_magic.decorator"]  # the map was read
    # The package's __init__ re-exports public names: importing a submodule runs it, which is not a design cycle.
    graph["air_magic"] = set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, set())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
