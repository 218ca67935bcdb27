"""The package's import map, read from its source with `ast` (nothing is imported or run): the walls between its parts,
no import cycle, and every `AIR_MAGIC_*` variable named in one module."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "air_magic"


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
    return name == "TYPE_CHECKING"


def _imports(module: str, node: ast.AST, top: bool, found: list[tuple[str, bool]]) -> None:
    """Append (imported air_magic module, at module level) for every import under `node`."""
    package = module if _modules()[module].name == "__init__.py" else module.rpartition(".")[0]
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            found += [(alias.name, top) for alias in child.names if alias.name.split(".")[0] == "air_magic"]
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                base = package.split(".")[: len(package.split(".")) - child.level + 1]
                source = ".".join(base + ([child.module] if child.module else []))
            else:
                source = child.module or ""
            if source.split(".")[0] != "air_magic":
                continue
            for alias in child.names:  # `from pkg import mod` imports pkg.mod; `from mod import name`, mod
                found.append((f"{source}.{alias.name}" if f"{source}.{alias.name}" in _modules() else source, top))
        elif _type_checking(child):
            continue  # only read by the type checker
        else:
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            _imports(module, child, top and not inner, found)


@cache
def _graph() -> dict[str, list[tuple[str, bool]]]:
    graph: dict[str, list[tuple[str, bool]]] = {}
    for module, path in _modules().items():
        found: list[tuple[str, bool]] = []
        _imports(module, ast.parse(path.read_text(), str(path)), True, found)
        graph[module] = found
    return graph


def _under(module: str, *parts: str) -> bool:
    """`module` is one of `parts` (names under air_magic; "" is the whole package) or inside one."""
    names = [f"air_magic.{p}" if p else "air_magic" for p in parts]
    return any(module == name or module.startswith(f"{name}.") for name in names)


def _crossings(source: tuple[str, ...], target: tuple[str, ...], unless: tuple[str, ...] = ()) -> list[str]:
    return sorted(
        f"{module} imports {imported}"
        for module, imports in _graph().items()
        if _under(module, *source) and not (unless and _under(module, *unless))
        for imported, _ in imports
        if _under(imported, *target)
    )


#: The listeners the owner plugs into each call (owner/listeners.py names them), and what they draw with.
_LISTENERS = ("display", "tracking", "watching", "profiling", "resources")
#: The front doors: what users call (the decorator, the magics, the command line, a sweep).
_FRONT_DOORS = ("magics", "cli", "decorator", "cell", "sweep", "jupyter")


def test_the_map_is_read_from_the_source():
    """The reader finds known imports, inside functions too, and each wall sees them (a wall that reads nothing
    guards nothing)."""
    imports = dict.fromkeys(_graph()["air_magic.owner.owner"])
    assert ("air_magic.calls.runner", True) in imports
    assert ("air_magic.display.follow", False) in imports
    assert "air_magic.launch.local.launcher imports air_magic.launch.boot" in _crossings(("",), ("launch.boot",))
    assert "air_magic.owner.listeners imports air_magic.display" in _crossings(("",), ("display",), unless=("launch",))


def test_the_launchers_import_nothing_above_them():
    """launch/ (the process boundary) imports no listener, display or front door, and nothing of the owner of calls
    (calls/: the runner, its outcome, the listener interface, sessions, the ledger)."""
    above = ("tracking", "watching", "display", "magics", "decorator", "cell", "cli", "calls")
    assert _crossings(("launch",), above) == []


def test_the_ray_launcher_does_not_import_the_local_one():
    """launch/ray/ shares with the local launcher only what sits in launch/ itself."""
    assert _crossings(("launch.ray",), ("launch.local",)) == []


def test_a_rank_imports_nothing_of_the_notebooks_or_the_helpers_side():
    """launch/rank/ (what runs in a rank) reaches no launcher, no launcher interface, no helper and no keeper."""
    notebook_or_helper = ("launch.local", "launch.ray", "launch.interface", "launch.keeper", "launch.rendezvous")
    assert _crossings(("launch.rank",), notebook_or_helper) == []


def test_the_run_directorys_formats_start_nothing_and_know_no_process():
    """launch/files/ (the run directory's formats) imports no launcher, rank, keeper or process stopper."""
    processes = ("launch.local", "launch.ray", "launch.rank", "launch.interface", "launch.keeper", "launch.stopper")
    assert _crossings(("launch.files",), processes) == []


def test_the_walls_of_the_layout_see_real_imports():
    """Each layout wall reads imports that exist (a wall that reads nothing guards nothing)."""
    assert "air_magic.launch.rank.worker imports air_magic.launch.files.rundir" in _crossings(
        ("launch.rank",), ("launch.files",)
    )
    assert "air_magic.launch.local.worlds imports air_magic.launch.keeper" in _crossings(
        ("launch.local",), ("launch.keeper",)
    )
    assert "air_magic.calls.runner imports air_magic.launch.protocol" in _crossings(("calls",), ("launch",))
    assert "air_magic.magics.execution imports air_magic.owner" in _crossings(("magics",), ("owner",))
    assert "air_magic.owner.listeners imports air_magic.display" in _crossings(("owner",), _LISTENERS)
    assert "air_magic.display.text imports air_magic.listeners" in _crossings(_LISTENERS, ("listeners",))


def test_only_load_ext_imports_the_magics():
    """magics/ (the IPython glue, split by topic) is reached only from `air_magic/__init__.py` (`%load_ext`); the
    plain modules below it never import it back."""
    assert set(_crossings(("",), ("magics",), unless=("magics",))) == {"air_magic imports air_magic.magics"}
    assert "air_magic.magics imports air_magic.magics.execution" in _crossings(("magics",), ("magics.execution",))


def test_calls_imports_no_listener_no_owner_and_no_front_door():
    """calls/ (the runner, the handle, the record, the ledger) speaks only the listener interface
    (air_magic/listeners.py): it imports no listener (display/, tracking/, watching/, the resource sampler), not even
    inside a function, nothing of the owner (air_magic/owner/, which plugs the listeners in) and no front door."""
    assert _crossings(("calls",), (*_LISTENERS, "owner", *_FRONT_DOORS)) == []


def test_the_listeners_import_nothing_of_calls_or_the_owner():
    """A listener (display/, tracking/, watching/, resources.py) knows the interface it implements, never the runner,
    the handles or the owner that plug it in."""
    doors = tuple(door for door in _FRONT_DOORS if door != "jupyter")  # the panel's links know the Jupyter server
    assert _crossings(_LISTENERS, ("calls", "owner", *doors)) == []


def test_only_the_front_doors_reach_the_owner():
    """The process's owner (air_magic/owner/) is reached from the front doors and the package's `__init__`; nothing
    below it imports it back."""
    below = sorted(
        module
        for module, imports in _graph().items()
        if not _under(module, "owner", *_FRONT_DOORS) and module != "air_magic"
        for imported, _ in imports
        if _under(imported, "owner")
    )
    assert below == []


def test_the_table_of_calls_assumes_no_kernel_and_no_runner():
    """calls/table.py (every call of the process that makes them: a kernel, a command line, a detached call)
    imports only the errors: no handle, runner, launcher, display or IPython glue."""
    imported = {i for i, _ in _graph()["air_magic.calls.table"]}
    assert imported == {"air_magic.errors"}


def test_only_the_panel_imports_ipywidgets():
    """ipywidgets is imported only by the panel's modules (display/widgets.py, rank_tabs.py, header.py), and the two
    parts only by the panel: the rest of the package runs without ipywidgets."""
    importers = set()
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(name.split(".")[0] == "ipywidgets" for name in names):
                importers.add(module)
    panel = {"air_magic.display.widgets", "air_magic.display.rank_tabs", "air_magic.display.header"}
    assert importers == panel
    parts = ("display.rank_tabs", "display.header")
    assert set(_crossings(("",), parts, unless=parts)) == {
        "air_magic.display.widgets imports air_magic.display.rank_tabs",
        "air_magic.display.widgets imports air_magic.display.header",
    }


def test_only_launch_imports_a_launcher():
    """Outside launch/, a launcher is reached through `air_magic.launch` (launcher_for, check_shape, ...)."""
    assert _crossings(("",), ("launch.local", "launch.ray"), unless=("launch",)) == []


def test_data_imports_nothing_above_it():
    """air_magic.data stands alone: it imports only its own modules."""
    outside = [m for m in _modules() if not _under(m, "data") and m != "air_magic"]
    assert _crossings(("data",), tuple(m.removeprefix("air_magic.") for m in outside)) == []


def test_no_import_cycle_between_modules():
    """Module-level imports form no cycle (an import inside a function may go back up)."""
    graph = {
        m: sorted({i for i, top in imports if top and i in _modules() and i != m}) for m, imports in _graph().items()
    }
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in graph[module]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert cycles == []


def _spelled(tree: ast.AST) -> list[int]:
    """Lines of string literals (docstrings aside) and keyword arguments that spell an AIR_MAGIC_ name."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and "AIR_MAGIC_" in node.value
        and id(node) not in docstrings
        or isinstance(node, ast.keyword)
        and (node.arg or "").startswith("AIR_MAGIC_")
    )


@pytest.mark.parametrize("module", sorted(set(_modules()) - {"air_magic.envvars"}))
def test_environment_variables_are_named_only_in_envvars(module):
    """Every AIR_MAGIC_* variable's name comes from air_magic/envvars.py (a docstring may mention one)."""
    assert _spelled(ast.parse(_modules()[module].read_text())) == [], f"{module} spells an AIR_MAGIC_ name"


def test_envvars_names_each_variable_once():
    """The module lists each name once, user-facing and internal apart, and the internal ones say so."""
    from air_magic import envvars

    assert not set(envvars.USER_FACING) & set(envvars.INTERNAL)
    assert len({*envvars.USER_FACING, *envvars.INTERNAL}) == len(envvars.USER_FACING) + len(envvars.INTERNAL)
    assert envvars.INTERNAL_RUN_DIR != envvars.RUNS_DIR and "INTERNAL" in envvars.INTERNAL_RUN_DIR
    documented = (PACKAGE.parent / "docs" / "environment.md").read_text()
    assert [name for name in envvars.USER_FACING if f"`{name}`" not in documented] == []
