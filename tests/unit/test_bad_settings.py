"""Bad settings of a call (counts, accelerator types, timeouts) are clear errors, raised before anything starts."""

from __future__ import annotations

import os

import psutil
import pytest

from air_magic import accelerators, distributed
from air_magic.errors import ConfigurationError

BAD_SETTINGS = [
    ({"num_accelerators": 0}, "num_accelerators must be at least 1"),
    ({"num_accelerators": -2}, "num_accelerators must be at least 1"),
    ({"num_accelerators": 1.5}, "num_accelerators must be a positive whole number"),
    ({"num_accelerators": "2"}, "num_accelerators must be a positive whole number"),
    ({"accelerator_type": "TPU_8xV5"}, "is not understood"),
    ({"accelerator_type": "GPU_2xH100"}, "none were detected"),
    ({"accelerator_type": 2}, "accelerator_type must be a string"),
    ({"timeout": True}, "timeout must be a number of seconds"),
    ({"timeout": 0}, "timeout must be more than 0 seconds"),
    ({"timeout": -1}, "timeout must be more than 0 seconds"),
    ({"timeout": "1h"}, "timeout must be a number of seconds"),
    ({"timeout": float("nan")}, "timeout must be more than 0 seconds"),
    ({"session": "two words"}, "a session name is a word"),
]


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"ranks": (0,), "session": None}, "no session is named"),
        ({"ranks": (), "session": "s"}, "ranks must be rank numbers"),
        ({"ranks": (-1,), "session": "s"}, "ranks must be rank numbers"),
        ({"ranks": "0,1", "session": "s"}, "ranks must be rank numbers"),
    ],
)
def test_ranks_are_checked_once_at_the_door_and_carried_sorted(changes, said):
    """ranks of a session call (both doors build Settings) come out sorted and once each; bad ones name the fix."""
    train = distributed(2, "CPU", session="s")(len)
    assert train.with_overrides(ranks=[2, 0, 2]).settings.ranks == (0, 2)
    with pytest.raises(ConfigurationError, match=said):
        train.with_overrides(**changes)


def test_bad_settings_are_clear_errors_and_start_nothing(tmp_path, monkeypatch):
    """Every bad count, type or timeout raises a ConfigurationError naming the setting, with no run directory or process
    made."""
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(tmp_path / "runs"))
    before = set(psutil.Process().children(recursive=True))
    for settings, message in BAD_SETTINGS:
        with pytest.raises(ConfigurationError, match=message):
            distributed(**settings)(print)
        with pytest.raises(ConfigurationError, match=message):
            distributed(num_accelerators=2, accelerator_type="CPU")(print).with_overrides(**settings)
    gpus = accelerators.Node(2, "H100")
    with pytest.raises(ConfigurationError, match="this node has 2 GPU"):
        accelerators.resolve(3, None, gpus)
    with pytest.raises(ConfigurationError, match="does not match this node, which has 'GPU_2xH100'"):
        accelerators.resolve(None, "GPU_2xA100", gpus)
    with pytest.warns(ResourceWarning, match="CPU workers on a machine with"):
        distributed(num_accelerators=(os.cpu_count() or 1) + 1, accelerator_type="CPU")(print)
    assert not (tmp_path / "runs").exists() or list((tmp_path / "runs").iterdir()) == []
    assert set(psutil.Process().children(recursive=True)) <= before, "a bad setting started a process"
