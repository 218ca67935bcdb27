"""Sphinx configuration of the air_magic documentation (Markdown pages through MyST; `make docs`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Document this checkout's air_magic, whatever else is installed; the API extension lives in _ext.
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent / "_ext")]

import air_magic

project = "air_magic"
author = "air_magic contributors"
release = air_magic.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "public_api",  # docs/_ext: the public-api directive; docstrings' parameter lines
]
source_suffix = {".md": "markdown"}
master_doc = "index"
# The docstrings write code in single backquotes, as Markdown does: show it as code, not as a title.
default_role = "code"
exclude_patterns = ["_build", "_ext"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Defaults as written in the source (`gpus=_UNSET`), not their repr.
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
# Worker-side and optional imports stay out of the build machine's way.
autodoc_mock_imports = ["deepspeed"]

html_theme = "furo"
html_title = f"air_magic {release}"
