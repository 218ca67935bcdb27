"""accelerators.parse_gpu_type: the one parser of accelerator type strings, used on one node and on Ray."""

from __future__ import annotations

import pytest

from air_magic.accelerators import parse_gpu_type
from air_magic.errors import ConfigurationError
from air_magic.launch.ray.cluster import check_shape


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("GPU_2xH100", (2, "H100")),
        (" gpu_8xh200 ", (8, "h200")),
        ("GPU", (None, None)),
        ("GPU_2", None),
        ("H100", None),
        ("GPU_x2H100", None),
        ("CPU", None),
    ],
)
def test_type_strings_parse_to_count_and_model(text, parsed):
    """Count and model, or None for what is not a GPU type string."""
    assert parse_gpu_type(text) == parsed


def test_the_ray_shape_check_uses_the_same_parser():
    """Ranks per node from the type's count; a contradicting count or a bad string is a ConfigurationError."""
    assert check_shape(None, "GPU_4xA100") == (4, "GPU_4xA100")
    assert check_shape(3, "GPU") == (3, "GPU")
    with pytest.raises(ConfigurationError, match="contradicts"):
        check_shape(2, "GPU_4xA100")
    with pytest.raises(ConfigurationError, match="not understood"):
        check_shape(None, "A100x4")
