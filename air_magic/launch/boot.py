"""How air_magic's own processes start: the boot line of a fresh interpreter, and the exit code of an internal failure.

A helper or rank started as a fresh interpreter (`python -c BOOT ...`) must import this
very copy of air_magic, whatever its sys.path: the boot line puts the directory holding
the package first, then calls one function of one module. Tests and tools find these
processes by the module name on their command line.
"""

from __future__ import annotations

from pathlib import Path

from ..envvars import PRELOAD as PRELOAD_ENV
from ..envvars import WARM

#: The directory that holds the air_magic package (put first on a fresh interpreter's sys.path).
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
#: Exit status of an air_magic process that failed inside air_magic itself (sysexits' EX_SOFTWARE).
INTERNAL_ERROR = 70


#: Modules a warm helper, and a Ray rank's actor, import before any call; AIR_MAGIC_PRELOAD (comma-separated)
#: replaces the list.
PRELOAD = ("torch", "torch.distributed", "numpy")


def preload_modules() -> tuple[str, ...]:
    """The modules to preload: AIR_MAGIC_PRELOAD's (an empty value: none), else PRELOAD."""
    import os

    wanted = os.environ.get(PRELOAD_ENV)
    return PRELOAD if wanted is None else tuple(n.strip() for n in wanted.split(",") if n.strip())


def warm_default() -> bool:
    """Ranks fork from a warm helper (and `ray_init` has the nodes start a worker ahead) unless AIR_MAGIC_WARM is
    0/false/no/off."""
    import os

    return os.environ.get(WARM, "1").strip().lower() not in {"0", "false", "no", "off"}


def boot_command(module: str, function: str = "main", parent: str = PACKAGE_PARENT) -> str:
    """The `python -c` program that imports `module` from `parent` and calls its `function()`."""
    return f"import sys; sys.path.insert(0, {parent!r}); from {module} import {function}; {function}()"
