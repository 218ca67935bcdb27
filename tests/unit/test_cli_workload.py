"""What a workload run is made of, without starting it: the code snapshot, the local secrets store, the
dependency list's forms, a node's environment, the fatal-line alerts and the runtime's states."""

from __future__ import annotations

import json
import os

import pytest

from air_magic.cli import dependencies, secrets
from air_magic.cli.files import WorkloadDir
from air_magic.cli.node import node_env
from air_magic.cli.output import state
from air_magic.cli.schema import JobFileError
from air_magic.cli.snapshot import Snapshot, root_path
from air_magic.envvars import SECRETS_FILE
from air_magic.watching import fatal_lines as alerts


def _tree(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_a_snapshot_leaves_out_git_and_what_gitignore_names(tmp_path):
    """Without git:, the working tree is copied at once: .git, ._ files and .gitignore's patterns left out."""
    src = tmp_path / "proj"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("x")
    (src / ".gitignore").write_text("*.ckpt\n__pycache__/\n/out\n!keep.ckpt\n")
    for name in ("train.py", "pkg/m.py", "pkg/__pycache__/m.pyc", "w.ckpt", "keep.ckpt", "out/log", "._train.py"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(name)
    copy = Snapshot(src).take(tmp_path / "dest")
    (src / "train.py").write_text("edited after the snapshot")
    assert copy == tmp_path / "dest" / "proj"
    assert _tree(copy) == [".gitignore", "pkg/m.py", "train.py"]
    assert (copy / "train.py").read_text() == "train.py"


def test_a_runs_directory_inside_the_root_is_not_copied_into_its_own_run(tmp_path, monkeypatch):
    """`root_path: .` with AIR_MAGIC_RUNS_DIR under it: the snapshot, taken into a run directory there, leaves the
    runs out (it copied itself into itself until the path was too long, and every earlier run with it)."""
    src = tmp_path / "proj"
    (src / "runs" / "20261207-old-run").mkdir(parents=True)
    (src / "runs" / "20261207-old-run" / "rank-0.log").write_text("an earlier run")
    (src / "train.py").write_text("train")
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(src / "runs"))
    copy = Snapshot(src).take(src / "runs" / "20261207-new-run" / "code_source")
    assert _tree(copy) == ["train.py"]


def test_include_paths_copy_only_those_and_must_exist(tmp_path):
    (tmp_path / "p" / "src").mkdir(parents=True)
    (tmp_path / "p" / "src" / "a.py").write_text("a")
    (tmp_path / "p" / "b.py").write_text("b")
    assert _tree(Snapshot(tmp_path / "p", None, ("src",)).take(tmp_path / "d")) == ["src/a.py"]
    with pytest.raises(JobFileError, match="include_paths: 'nope' does not exist"):
        Snapshot(tmp_path / "p", None, ("nope",)).check()


def test_root_path_reads_vars_home_and_project_root(tmp_path, monkeypatch):
    (tmp_path / "code").mkdir()
    monkeypatch.setenv("WHERE", str(tmp_path))
    assert root_path("$WHERE/code", tmp_path / "elsewhere") == tmp_path / "code"
    assert root_path("project_root/code", tmp_path) == tmp_path / "code"


def test_secrets_come_from_a_variable_per_key_or_a_private_file(tmp_path, monkeypatch):
    """scope/key is AIR_MAGIC_SECRET_SCOPE_KEY, else the 0600 file's scope: {key: value}; a file others can
    read is refused; the missing ones are named in one error, with where to put each."""
    store = tmp_path / "secrets.yaml"
    store.write_text("team: {wandb-key: from-file}\n")
    store.chmod(0o600)
    monkeypatch.setenv(SECRETS_FILE, str(store))
    monkeypatch.setenv(secrets.env_name("my-scope/hf-token"), "from-env")
    assert secrets.env_name("my-scope/hf-token") == "AIR_MAGIC_SECRET_MY_SCOPE_HF_TOKEN"
    got = secrets.resolve({"HF_TOKEN": "my-scope/hf-token", "WANDB": "team/wandb-key"})
    assert got == {"HF_TOKEN": "from-env", "WANDB": "from-file"}
    with pytest.raises(
        JobFileError, match=r"secrets not found on this machine: A \(team/a: set AIR_MAGIC_SECRET_TEAM_A"
    ):
        secrets.resolve({"A": "team/a"})
    store.chmod(0o644)
    with pytest.raises(JobFileError, match="chmod 600"):
        secrets.resolve({"WANDB": "team/wandb-key"})


def test_the_dependency_list_takes_the_runtimes_forms(tmp_path):
    """Pip specs, -r files, .whl paths, index flags and per-dependency flags; what is not installed is named."""
    (tmp_path / "requirements.txt").write_text("# pinned\npyyaml\nno-such-package-xyz>=1  # comment\n")
    entries = [
        "--index-url https://example.invalid/simple",
        "-r requirements.txt",
        "--no-deps packaging",
        "/wheels/another_missing_pkg-1.0-py3-none-any.whl",
        "pyyaml<1",
    ]
    assert dependencies.missing(entries, tmp_path) == [
        "no-such-package-xyz>=1",
        "pyyaml<1 (pyyaml " + __import__("yaml").__version__ + " is installed)",
        "another_missing_pkg==1.0",
    ]
    with pytest.raises(JobFileError, match="--trusted-host is not supported"):
        dependencies.missing(["--trusted-host example.invalid"], tmp_path)


def test_a_nodes_command_gets_the_runtimes_variables_and_not_the_ranks(tmp_path):
    """NUM_NODES, NODE_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, CODE_SOURCE_PATH, HYPERPARAMETERS_PATH, the
    file's variables and secrets; the rank's RANK, LOCAL_RANK, WORLD_SIZE and torchelastic variables removed."""
    files = WorkloadDir(tmp_path)
    files.hyperparameters.write_text("lr: 0.1\n")
    base = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "TORCHELASTIC_RUN_ID": "x",
        "MASTER_PORT": "1",
        "HOME": "/h",
    }
    node = {
        "num_nodes": 1,
        "node_rank": 0,
        "local_world_size": 2,
        "master_addr": "127.0.0.1",
        "master_port": 29555,
        "code_source": "repo",
        "env_variables": {"LR": "0.5"},
        "secrets": {"TOKEN": "s"},
    }
    env = node_env(base, node, files, tmp_path / "code_source" / "repo")
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"} & set(env)
    assert {k: env[k] for k in ("NUM_NODES", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "LR", "TOKEN")} == {
        "NUM_NODES": "1",
        "NODE_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_PORT": "29555",
        "LR": "0.5",
        "TOKEN": "s",
    }
    assert env["CODE_SOURCE_PATH"] == str(tmp_path / "code_source" / "repo")
    assert env["HYPERPARAMETERS_PATH"] == str(files.hyperparameters) and env["HOME"] == "/h"
    assert (env["POD_RANK"], env["IS_HOST"], env["LOCAL_ADDR"]) == ("0", "1", "127.0.0.1")  # the older docs' names
    other = node_env(base, {**node, "node_rank": 1}, files, tmp_path / "code_source" / "repo")
    assert (other["POD_RANK"], other["IS_HOST"]) == ("1", "0")


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
        ("[rank3]:[E] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)", "nccl"),
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", "xid"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda"),
        ("Segmentation fault (core dumped)", "segfault"),
        ("Killed", "killed"),
        ("torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. TCPStore", "store"),
        ("bash: line 1: torchrunn: command not found", "command_not_found"),
        ("ERROR: Script failed with exit code 2 after 31s", "script_failed"),
        ("epoch 1 loss 0.25", None),
        ("ERROR: Script failed with exit code 0 after 31s", None),
    ],
)
def test_fatal_lines_are_alerts_of_their_kind(line, kind):
    assert alerts.kind_of(line) == kind


def test_a_run_whose_last_attempt_timed_out_is_timedout(tmp_path):
    """A failed call reads FAILED, and TIMEDOUT when a node of its last attempt ran past timeout_minutes."""
    files = WorkloadDir(tmp_path)
    record = {"status": "failed", "world_size": 1}
    files.attempt(0).mkdir(parents=True)
    files.node_end(0, 0).write_text(json.dumps({"exit_code": 1, "timed_out": False}))
    assert state(tmp_path, record) == "FAILED"
    files.attempt(1).mkdir(parents=True)
    files.node_end(1, 0).write_text(json.dumps({"exit_code": -15, "timed_out": True}))
    assert state(tmp_path, record) == "TIMEDOUT"
    assert [state(tmp_path, {"status": s}) for s in ("waiting", "running", "finished", "cancelled")] == [
        "PENDING",
        "RUNNING",
        "SUCCESS",
        "CANCELED",
    ]
    assert os.path.basename(files.node_log(1, 0)) == "node_0.log"
