"""`environment.dependencies` as users meet it, `air-magic` a subprocess, offline: a wheel the environment lacks
(`am_layer_probe`, written here) is installed into a cached environment layered over this one, never into it, and
what this environment has (pyyaml, torch) is not installed again; the command's `python` and torchrun see both; the
next run reuses it; AIR_MAGIC_INSTALL=never refuses naming it; --dry-run says what would be installed and makes
nothing; a failed install is refused before anything starts."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WHEEL = "am_layer_probe-1.0-py3-none-any.whl"

JOB = f"""\
experiment_name: layer-tests
environment:
  dependencies: [--no-index, wheels/{WHEEL}, pyyaml]
compute: {{num_accelerators: 1, accelerator_type: CPU}}
max_retries: 0
command: |
  python -c "import sys, am_layer_probe, yaml, torch; print('probe', am_layer_probe.VERSION, 'prefix', sys.prefix, \\
    'yaml', yaml.__file__, 'torch', torch.__version__)"
  torchrun --nproc_per_node=1 -m am_layer_probe
"""

#: The files of the directory the fixture `cli` (tests/conftest.py) runs `air-magic` in.
CLI_FILES = {
    "job.yaml": JOB,
    "bad.yaml": JOB.replace(", pyyaml]", ", pyyaml, no-such-package-xyz]"),
}


def _wheel(path: Path) -> None:
    """A wheel of `am_layer_probe` 1.0, written by hand (nothing is built or downloaded): its VERSION, and a
    __main__ that prints the RANK torchrun gives it."""
    files = {
        "am_layer_probe/__init__.py": "VERSION = '1.0'\n",
        "am_layer_probe/__main__.py": "import os\nprint('probe main rank', os.environ.get('RANK'), flush=True)\n",
        "am_layer_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: am_layer_probe\nVersion: 1.0\n",
        "am_layer_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append("am_layer_probe-1.0.dist-info/RECORD,,")
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
        wheel.writestr("am_layer_probe-1.0.dist-info/RECORD", "\n".join(record) + "\n")


@pytest.fixture(scope="module")
def env(cli):
    """The `cli` directory with the wheel, and an environment whose cache ($XDG_CACHE_HOME) is the test's own."""
    _wheel(cli.root / "wheels" / WHEEL)
    return {**cli.env, "XDG_CACHE_HOME": str(cli.root / "cache")}


def air_magic(cli, env, *args: str, **extra: str):
    from helpers import air_magic_cli

    return air_magic_cli(cli.root, {**env, **extra}, *args)


def _runs(cli) -> list[str]:
    return sorted(p.name for p in (cli.root / "runs").iterdir() if p.is_dir() and not p.name.startswith("."))


def test_a_dry_run_and_never_install_nothing_and_name_what_is_missing(cli, env):
    """--dry-run names the wheel as what would be installed, and the cached environment's path (not made); with
    AIR_MAGIC_INSTALL=never, run refuses naming it (exit 2); neither makes anything."""
    done = air_magic(cli, env, "run", "-f", "job.yaml", "--dry-run", "-o", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout.splitlines()[-1])["data"]
    assert data["would_install"] == ["am_layer_probe==1.0"]
    envs = cli.root / "cache" / "air_magic" / "envs"
    assert Path(data["install_into"]["path"]).parent == envs and data["install_into"]["cached"] is False
    assert data["on_this_machine"] == "runs as written"
    text = air_magic(cli, env, "run", "-f", "job.yaml", "--dry-run")
    assert "would_install: am_layer_probe==1.0" in text.stdout and f"path={envs}" in text.stdout
    refused = air_magic(cli, env, "run", "-f", "job.yaml", AIR_MAGIC_INSTALL="never")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "not installed in" in refused.stderr and "am_layer_probe==1.0" in refused.stderr
    assert "AIR_MAGIC_INSTALL=never" in refused.stderr
    assert not (cli.root / "cache").exists() and _runs(cli) == []


def test_what_is_missing_goes_into_a_cached_layer_used_by_python_and_torchrun(cli, env):
    """The run installs the wheel into the cached environment (pyyaml, which this environment has, is not installed
    again) and its command's `python` (the layer's) and torchrun's rank (this environment's python) import it with
    yaml and torch; this environment still lacks it; the second run uses the cached environment."""
    done = air_magic(cli, env, "run", "-f", "job.yaml", "--watch")
    assert done.returncode == 0, done.stdout + done.stderr
    envs = cli.root / "cache" / "air_magic" / "envs"
    (layer,) = [p for p in envs.iterdir() if p.is_dir()]
    assert f"air-magic: installing 1 package(s) into the cached environment {layer}" in done.stderr
    import torch
    import yaml

    line = f"[node 0] probe 1.0 prefix {layer} yaml {yaml.__file__} torch {torch.__version__}"
    assert line in done.stdout
    assert "probe main rank 0" in done.stdout
    assert importlib.util.find_spec("am_layer_probe") is None  # never installed into this environment
    site_packages = next((layer / "lib").glob("python*/site-packages"))
    assert (site_packages / "am_layer_probe" / "__init__.py").exists() and (layer / ".complete").exists()
    assert not list(site_packages.glob("yaml*")) and not list(site_packages.glob("[Pp]y[Yy][Aa][Mm][Ll]*"))
    assert not list(site_packages.glob("torch*"))
    (run_id,) = _runs(cli)
    log = (cli.root / "runs" / run_id / "install.log").read_text()
    assert "Requirement already satisfied: pyyaml" in log and "Successfully installed am-layer-probe-1.0" in log

    again = air_magic(cli, env, "run", "-f", "job.yaml", "--watch")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"air-magic: using the cached environment {layer}" in again.stderr
    assert "installing" not in again.stderr and line in again.stdout
    assert [p for p in envs.iterdir() if p.is_dir()] == [layer]
    cached = air_magic(cli, env, "run", "-f", "job.yaml", "--dry-run", "-o", "json")
    assert json.loads(cached.stdout.splitlines()[-1])["data"]["install_into"] == {"path": str(layer), "cached": True}


def test_a_failed_install_is_refused_with_pips_lines_and_nothing_starts(cli, env):
    """A requirement no index has (--no-index): exit 2, pip's last lines naming it, the log kept beside the
    removed environment; no run is started."""
    before = _runs(cli)
    done = air_magic(cli, env, "run", "-f", "bad.yaml")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "installing no-such-package-xyz, am_layer_probe==1.0 failed" in done.stderr
    assert "No matching distribution found for no-such-package-xyz" in done.stderr
    assert "nothing was started" in done.stderr
    envs = cli.root / "cache" / "air_magic" / "envs"
    (kept,) = envs.glob("*.failed.log")
    assert not (envs / kept.name.removesuffix(".failed.log")).exists()
    assert _runs(cli) == before
