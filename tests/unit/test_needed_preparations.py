"""Which of the helper's pending preparations a call's ranks need: those whose PRELOADS the call's payload names."""

from __future__ import annotations

import sys

import pytest

from air_magic.launch.local.preload import Preloaded


@pytest.fixture
def pending(tmp_path, monkeypatch):
    """A helper's import cache with the hook `needhook` (PRELOADS "somepkg") and one without PRELOADS asked for."""
    (tmp_path / "needhook.py").write_text("PRELOADS = ('somepkg',)\n\ndef preload(env):\n    return []\n")
    (tmp_path / "plainhook.py").write_text("def preload(env):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    preloaded = Preloaded(warm=False)
    preloaded.ask(["needhook", "plainhook"], {})
    yield preloaded, tmp_path / "payload.pkl"
    for name in ("needhook", "plainhook"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("payload", "needed"),
    [
        (b"\x8c\x07somepkg\x94", ["needhook"]),  # a name the pickled code uses
        (b"import somepkg.sub\n", ["needhook"]),  # a cell's or a by-value module's source
        (b"somepkg_utils and othersomepkg", []),  # only as part of other names
        (b"nothing here", []),
        (b"", []),  # an empty payload
    ],
)
def test_a_call_needs_the_preparations_whose_packages_its_payload_names(pending, payload, needed):
    """A call needs a pending preparation when its payload names a package the hook preloads, as a whole name."""
    preloaded, path = pending
    path.write_bytes(payload)
    assert preloaded.needed_by(path) == needed


def test_a_call_needs_nothing_once_no_preparation_is_pending(pending):
    """With nothing pending (done, or never asked), no call waits, whatever its payload names."""
    preloaded, path = pending
    path.write_bytes(b"import somepkg")
    preloaded.run_preparations()
    assert preloaded.needed_by(path) == []
    assert preloaded.needed_by(path.with_name("missing.pkl")) == []
