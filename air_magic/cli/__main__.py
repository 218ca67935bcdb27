"""`python -m air_magic.cli`: the same as the `air-magic` console script."""

from . import run

run()
