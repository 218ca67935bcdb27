"""The Ray versions air_magic's uses of Ray's private names were checked with are the ones its `ray` extra allows."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from air_magic.launch.ray._compat import RAY_VERSIONS

ROOT = Path(__file__).resolve().parents[2]


def test_the_ray_extra_allows_the_checked_versions_and_the_installed_ray_is_one_of_them():
    """pyproject's `ray` extra names `RAY_VERSIONS`, and the Ray installed here (the tests') lies in that range."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["ray"] == [f"ray[default]{RAY_VERSIONS}"]
    try:
        installed = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Ray is not installed here")
    assert installed in SpecifierSet(RAY_VERSIONS)
