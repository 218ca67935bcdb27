"""The cached environment of a workload's missing dependencies, without making one: the entries' flags as pip gets
them, the layer's key, where it is, when it is refused instead (AIR_MAGIC_INSTALL=never, several nodes), and the
command's environment with it."""

from __future__ import annotations

import os
import sys

import pytest

from air_magic.cli import dependencies, layer
from air_magic.cli.files import WorkloadDir
from air_magic.cli.node import RANK_HOOK_DIR, node_env
from air_magic.cli.schema import JobFileError
from air_magic.envvars import INSTALL


def test_the_entries_flags_are_read_as_pip_reads_them(tmp_path):
    """Whole-list flags (with `=` or a space, --no-index), per-dependency flags (sorted, so their order does not
    matter), -r files and wheels made absolute from the workload file's directory; a flag not taken is refused."""
    got = dependencies.parse(
        [
            "--index-url=https://example.invalid/simple",
            "-f  /wheels",
            "--no-index",
            "--no-deps   --force-reinstall pkg-a>=1",
            "-r reqs/requirements.txt",
            "--no-deps dist/p-1.0-py3-none-any.whl",
        ],
        tmp_path,
    )
    assert [(e.kind, e.words, e.flags) for e in got] == [
        ("index", ("--index-url", "https://example.invalid/simple"), ()),
        ("index", ("-f", "/wheels"), ()),
        ("index", ("--no-index",), ()),
        ("requirement", ("pkg-a>=1",), ("--force-reinstall", "--no-deps")),
        ("file", ("-r", str(tmp_path / "reqs" / "requirements.txt")), ()),
        ("wheel", (str(tmp_path / "dist" / "p-1.0-py3-none-any.whl"),), ("--no-deps",)),
    ]
    assert got[3].text == "--force-reinstall --no-deps pkg-a>=1"
    with pytest.raises(JobFileError, match="--pre is not taken here"):
        dependencies.parse(["--pre torch"], tmp_path)
    with pytest.raises(JobFileError, match="--index-url needs a value"):
        dependencies.parse(["--index-url"], tmp_path)


def test_pip_gets_one_install_per_set_of_flags_and_no_flag_for_what_is_installed(tmp_path):
    """The entries without flags in one pip install, with the whole-list flags; a missing entry with flags in one
    of its own; an installed one (pyyaml here) with flags joins the plain install without them."""
    installs = dependencies.pip_installs(
        [
            "--no-index",
            "--find-links /wheels",
            "no-such-package-xyz",
            "--no-deps no-such-other-xyz",
            "--no-deps --no-cache-dir another-missing-xyz",
            "--force-reinstall pyyaml",
        ],
        tmp_path,
    )
    assert installs == [
        ["--no-index", "--find-links", "/wheels", "no-such-package-xyz", "pyyaml"],
        ["--no-index", "--find-links", "/wheels", "--no-deps", "no-such-other-xyz"],
        ["--no-index", "--find-links", "/wheels", "--no-cache-dir", "--no-deps", "another-missing-xyz"],
    ]


def test_the_layers_key_is_the_python_the_environment_the_entries_and_the_wheels_content(tmp_path, monkeypatch):
    """The same list written with other spacing is the same layer; another flag, a wheel's new content, what is
    lacking, or another environment (sys.prefix) is another one. Naming it makes nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    wheel = tmp_path / "p-1.0-py3-none-any.whl"
    wheel.write_bytes(b"one")
    lacking = ["p==1.0"]

    def of(*entries: str, lacking: list[str] = lacking) -> layer.Layer:
        return layer.Layer.of(list(entries), tmp_path, lacking)

    first = of("--no-index", "p-1.0-py3-none-any.whl", "pyyaml")
    assert first.path.parent == tmp_path / "cache" / "air_magic" / "envs"
    assert of(" --no-index", "./p-1.0-py3-none-any.whl ", "pyyaml").path == first.path
    assert of("--no-index", "--no-deps p-1.0-py3-none-any.whl", "pyyaml").path != first.path
    assert of("--no-index", "p-1.0-py3-none-any.whl", "pyyaml", lacking=["p==1.0", "x"]).path != first.path
    wheel.write_bytes(b"two")
    assert of("--no-index", "p-1.0-py3-none-any.whl", "pyyaml").path != first.path
    wheel.write_bytes(b"one")
    assert of("--no-index", "p-1.0-py3-none-any.whl", "pyyaml").path == first.path
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert of("--no-index", "p-1.0-py3-none-any.whl", "pyyaml").path != first.path
    assert not (tmp_path / "cache").exists() and not first.cached
    assert first.installs == (("--no-index", str(wheel), "pyyaml"),)
    assert first.site_packages == first.path / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / (
        "site-packages"
    )
    wheel.unlink()
    with pytest.raises(JobFileError, match="p-1.0-py3-none-any.whl"):
        of("p-1.0-py3-none-any.whl")


def test_never_and_several_nodes_refuse_naming_what_is_missing(monkeypatch):
    """AIR_MAGIC_INSTALL=never refuses as before; several nodes refuse (the layer is this machine's); otherwise what
    is missing is installed (no refusal); another value of the variable is an error."""
    monkeypatch.delenv(INSTALL, raising=False)
    assert dependencies.refusal(["am_probe==1.0"]) is None and dependencies.refusal([], 4) is None
    assert "runs on 2 nodes" in (dependencies.refusal(["am_probe==1.0"], 2) or "")
    monkeypatch.setenv(INSTALL, "never")
    why = dependencies.refusal(["am_probe==1.0"]) or ""
    assert f"not installed in {sys.prefix}: am_probe==1.0" in why and "AIR_MAGIC_INSTALL=never" in why
    monkeypatch.setenv(INSTALL, "sometimes")
    with pytest.raises(JobFileError, match="AIR_MAGIC_INSTALL='sometimes'"):
        dependencies.refusal(["am_probe==1.0"])


def test_the_command_has_the_layer_first_on_path_and_pythonpath_after_the_rank_hook(tmp_path):
    """The layer's bin before this environment's (its `python`), its site-packages on PYTHONPATH after the rank
    hook and before the user's own PYTHONPATH."""
    node = {
        "num_nodes": 1,
        "node_rank": 0,
        "local_world_size": 1,
        "master_addr": "127.0.0.1",
        "master_port": 29555,
        "layer": {"PATH": "/cache/envs/k/bin", "PYTHONPATH": "/cache/envs/k/lib/site-packages"},
    }
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/mine"}
    env = node_env(base, node, WorkloadDir(tmp_path), tmp_path, tmp_path / "ranks")
    assert env["PATH"].split(os.pathsep) == ["/cache/envs/k/bin", os.path.dirname(sys.executable), "/usr/bin"]
    assert env["PYTHONPATH"].split(os.pathsep) == [str(RANK_HOOK_DIR), "/cache/envs/k/lib/site-packages", "/mine"]
    plain = node_env(base, {**node, "layer": None}, WorkloadDir(tmp_path), tmp_path)
    assert plain["PYTHONPATH"] == "/mine"
