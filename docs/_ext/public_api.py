"""Sphinx directives that read the package at build time, so the pages follow the code.

    ```{public-api} air_magic
    ```

expands to one autodoc entry per name in `air_magic.__all__` (class, exception or function, in an
`eval-rst` block: the directive belongs in a Markdown page), so a name added to or removed from `__all__`
shows up (or fails the build) without editing the page. An alias of a class documented under its own
name is written as one line pointing to it, so nothing is described twice.

    ```{module-map} air_magic
    ```

expands to a table of the package's modules and the first paragraph of each one's docstring.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList
from sphinx.util.nodes import nested_parse_with_titles

#: Names in `__all__` that are not API objects to describe (the version is shown in the page title).
SKIP = {"__version__"}


def _directive(name: str, target: str, *body: str) -> list[str]:
    """One reST directive; the whole list goes to the page inside one MyST `eval-rst` block."""
    return [f".. {name}:: {target}", *(f"   {line}" for line in body), ""]


def _entry(module: str, name: str, obj: Any) -> list[str]:
    target = f"{module}.{name}"
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return _directive("autoexception", target)
    if inspect.isclass(obj):
        return _directive("autoclass", target)
    if callable(obj):
        return _directive("autofunction", target)
    return _directive("autodata", target, ":no-value:")


class PublicApi(Directive):
    """`public-api MODULE`: autodoc entries for everything in MODULE.__all__."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        module = importlib.import_module(module_name)
        lines: list[str] = []
        documented: dict[int, str] = {}
        names = [n for n in module.__all__ if n not in SKIP]
        # Canonical names first, so an alias can point to the entry of the object it names.
        names.sort(key=lambda n: getattr(getattr(module, n), "__name__", n) != n)
        for name in names:
            obj = getattr(module, name)
            if inspect.isclass(obj) and id(obj) in documented:
                lines += _directive("py:class", f"{module_name}.{name}", "", f"The same class as :class:`{documented[id(obj)]}`.")
                continue
            if inspect.isclass(obj):
                documented[id(obj)] = f"{module_name}.{name}"
            lines += _entry(module_name, name, obj)
        # autodoc writes reST, so its entries must be parsed as reST inside a Markdown page.
        lines = ["```{eval-rst}", *lines, "```"]
        content = StringList(lines, source=f"<public-api {module_name}>")
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, content, node)
        return node.children


class ModuleMap(Directive):
    """`module-map PACKAGE`: a table of the package's modules and the first line of each one's docstring.

    The files are read, not imported, so modules that need optional packages (Ray) are listed too.
    """

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        spec = importlib.util.find_spec(self.arguments[0])
        assert spec is not None and spec.submodule_search_locations, f"{self.arguments[0]} is not a package"
        root = Path(next(iter(spec.submodule_search_locations)))
        rows = ["| module | what it is for |", "|---|---|"]
        for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).parts):
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            first = doc.strip().split("\n\n")[0].replace("\n", " ").replace("|", "\\|")
            name = path.relative_to(root.parent).as_posix()
            rows.append(f"| `{name}` | {first} |")
            self.state.document.settings.record_dependencies.add(str(path))
        content = StringList(rows, source=f"<module-map {self.arguments[0]}>")
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, content, node)
        return node.children


#: A parameter line of this project's docstrings: `name: text` or `a, b: text`, continued on indented lines.
_PARAM = re.compile(r"^([A-Za-z_]\w*(?:, [A-Za-z_]\w*)*): (.*)$")


def parameter_fields(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Read the docstrings' `name: text` parameter lines as a reST definition list (autodoc-process-docstring)."""
    out: list[str] = []
    in_items = False
    for line in lines:
        match = _PARAM.match(line)
        if match:
            if out and out[-1].strip() and not in_items:
                out.append("")
            names = ", ".join(f"``{n}``" for n in match.group(1).split(", "))
            out += [names, f"    {match.group(2)}"]
            in_items = True
        elif in_items and line.strip() and line[0].isspace():
            out.append(line)
        else:
            if in_items and line.strip():
                out.append("")
            in_items = False
            out.append(line)
    lines[:] = out


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("public-api", PublicApi)
    app.add_directive("module-map", ModuleMap)
    app.connect("autodoc-process-docstring", parameter_fields)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
