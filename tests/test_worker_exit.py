"""A rank's exit skips torch's operator-library teardown (0.15 s a rank) and keeps every other exit finalizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_PROBE = """
import tempfile, weakref, torch
from air_magic.launch.rank.worker import _skip_teardown_finalizers
kept = tempfile.TemporaryDirectory()
registry = weakref.finalize._registry
torch_libs = [f for f, info in registry.items() if info.func is torch.library._del_library]
_skip_teardown_finalizers()
print(len(torch_libs), sum(f.atexit for f in torch_libs), kept._finalizer.atexit)
"""


def test_only_torchs_library_teardown_is_skipped_at_exit():
    """torch's Library finalizers no longer run at exit; a temporary directory's cleanup still does."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True, cwd=root
    )
    found, still_at_exit, others_kept = out.stdout.split()
    assert int(found) > 0, "torch registers library finalizers (else this test checks nothing)"
    assert int(still_at_exit) == 0
    assert others_kept == "True"
