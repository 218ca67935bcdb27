"""The program a %%distributed cell becomes: cell source plus the notebook globals it uses.

`CellProgram` is a plain picklable callable. In the notebook it is built from
the cell's text and the notebook namespace (only the globals the cell uses
are kept); on each rank it compiles the source under the cell's own file
name, with line numbers as the notebook shows them, runs it, and returns the
value of the last expression (like IPython's Out[n]).

It is not for IPython glue (that is magics/) and it imports no IPython,
so a worker that runs a cell carries only what the user's code imports.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import io
import linecache
import symtable
import tokenize
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .payload import cell_sources, referenced_globals

_UNBOUND = object()  # a name that was not in the namespace before the cell ran


def used_names(source: str, filename: str = "<cell>") -> set[str]:
    """Global names the code reads: at module level, and free in its functions, classes and comprehensions.

    Raises SyntaxError for source that does not parse.
    """
    top = symtable.symtable(source, filename, "exec")
    names = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    stack = list(top.get_children())
    while stack:
        table = stack.pop()
        names.update(s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced())
        stack.extend(table.get_children())
    return names


def ends_with_semicolon(source: str) -> bool:
    """True when the last code token is ';', which in IPython means 'show no result'."""
    last = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type not in (
                tokenize.COMMENT,
                tokenize.NL,
                tokenize.NEWLINE,
                tokenize.INDENT,
                tokenize.DEDENT,
                tokenize.ENDMARKER,
            ):
                last = tok
    except (tokenize.TokenError, SyntaxError):
        return False
    return last is not None and last.type == tokenize.OP and last.string == ";"


def _notebook_code(values: Iterable[Any]) -> list[Any]:
    """Functions that code cells defined, reachable from `values`: their frames need the cell's lines.

    Follows functions into the globals they use and classes into their
    methods; stops at anything that lives in an importable module.
    """
    found: list[Any] = []
    seen: set[int] = set()
    stack = list(values)
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (staticmethod, classmethod)):
            stack.append(value.__func__)
        elif isinstance(value, property):
            stack.extend(f for f in (value.fget, value.fset, value.fdel) if f is not None)
        elif inspect.isfunction(value) and value.__module__ == "__main__":
            found.append(value)
            stack.extend(referenced_globals(value).values())
        elif inspect.isclass(value) and value.__module__ == "__main__":
            stack.extend(vars(value).values())
    return found


@dataclass
class CellProgram:
    """A cell to run on every rank; calling it runs the cell and returns its last expression's value."""

    source: str
    filename: str
    first_line: str = ""
    line_offset: int = 1
    used_globals: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        source: str,
        filename: str,
        namespace: Mapping[str, Any],
        hidden: Mapping[str, Any] | None = None,
        first_line: str = "",
        line_offset: int = 1,
    ) -> CellProgram:
        """Check the cell parses and keep the globals of `namespace` it uses.

        `hidden` holds names the shell put there itself (In, Out, get_ipython,
        exit, ...): they are left behind unless the user rebound them.
        `line_offset` is how many lines of the cell come before `source`
        (the `%%distributed` line), so line numbers match what the notebook shows.
        """
        program = cls(source=source, filename=filename, first_line=first_line, line_offset=line_offset)
        code = program.numbered_source()
        compile(code, filename, "exec", ast.PyCF_ONLY_AST)  # a SyntaxError names the cell's line
        hidden = hidden or {}
        for name in sorted(used_names(code, filename)):
            if name.startswith("__") and name.endswith("__") or name not in namespace:
                continue
            value = namespace[name]
            if name in hidden and hidden[name] is value:
                continue
            program.used_globals[name] = value
        return program

    def numbered_source(self) -> str:
        """The source, shifted down so that line numbers are the cell's own."""
        return "\n" * self.line_offset + self.source

    def cell_lines(self) -> list[str]:
        """The cell as the notebook shows it, line by line, for tracebacks."""
        head = [self.first_line + "\n"] if self.first_line else []
        head += ["\n"] * (self.line_offset - len(head))
        return head + [line + "\n" for line in self.source.splitlines()]

    # -- what payload.serialize asks of a target -----------------------------
    def payload_globals(self) -> dict[str, Any]:
        """The notebook globals this cell takes along, so an unpicklable one can be named."""
        return dict(self.used_globals)

    def payload_sources(self) -> dict[str, Any]:
        """The cell's lines, and those of notebook functions it uses, for remote tracebacks."""
        files: dict[str, list[str]] = {}
        code: dict[str, str] = {}
        for func in _notebook_code(self.used_globals.values()):
            found = cell_sources(func)
            files.update(found["files"])
            code.update(found["code"])
        files[self.filename] = self.cell_lines()
        return {"files": files, "code": code}

    # -- on a rank -----------------------------------------------------------
    def __call__(self) -> Any:
        """Run the cell in a fresh namespace made of the globals it uses; return its last expression's value."""
        return self.run_in({"__name__": "__main__", "__builtins__": builtins})

    def run_in(self, namespace: dict[str, Any], owned: set[str] | None = None) -> Any:
        """Run the cell in `namespace` (a session's); return its last expression's value.

        The notebook globals the cell uses are put in first, except the names in `owned` (those the session
        assigned itself, which win); every name the cell then binds is added to `owned`.
        """
        lines = self.cell_lines()
        linecache.cache[self.filename] = (sum(map(len, lines)), None, lines, self.filename)
        owned = set() if owned is None else owned
        given = {name: value for name, value in self.used_globals.items() if name not in owned}
        namespace.update(given)
        before = dict(namespace)
        tree = ast.parse(self.numbered_source(), self.filename)
        last: ast.Expression | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            tree.body.pop()
        try:
            exec(compile(tree, self.filename, "exec"), namespace)  # noqa: S102 - running the cell is the point
            return None if last is None else eval(compile(last, self.filename, "eval"), namespace)
        finally:  # what the cell bound before it stopped (an error, an interrupt) is the session's too
            owned.intersection_update(namespace)
            owned.update(
                name
                for name, value in namespace.items()
                if not (name.startswith("__") and name.endswith("__")) and before.get(name, _UNBOUND) is not value
            )

    def __repr__(self) -> str:
        return f"<CellProgram {self.filename} using {sorted(self.used_globals)}>"
