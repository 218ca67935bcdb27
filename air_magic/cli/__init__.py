"""The `air-magic` command line (cli/main.py): a thin skin over the same owner of calls as the notebook."""

from __future__ import annotations

import sys

from .main import main

__all__ = ["main"]


def run() -> None:
    """The console script's entry point."""
    sys.exit(main())
