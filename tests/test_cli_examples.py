"""The runtime's documented workload files pass `air-magic run --dry-run` as written once their root_path is a local
git repository, and a snapshot's git pin takes the pinned commit (these start `git`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from air_magic.cli.main import main
from air_magic.cli.schema import JobFileError
from air_magic.cli.snapshot import Snapshot

pytestmark = pytest.mark.slow

EXAMPLES = sorted((Path(__file__).parent / "workloads").glob("*.yaml"))


def _git(path, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=path, check=True, capture_output=True
    )


def _repo(path: Path) -> Path:
    """A clean git repository with a branch `main` and a train.py, as the examples' root_path."""
    path.mkdir(exist_ok=True)
    (path / "train.py").write_text("print('train')\n")
    for args in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "first"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=path, check=True, capture_output=True
        )
    return path


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_documented_example_passes_dry_run_with_a_local_root_path(tmp_path, example, capsys):
    """The runtime's documented files pass --dry-run as written once root_path names a local directory; it
    says the nodes, the command, the variables and what would be installed, and starts nothing."""
    args = ["run", "-f", str(example), "--dry-run", "-o", "json"]
    if "root_path" in example.read_text():
        args += ["--override", f"code_source.snapshot.root_path={_repo(tmp_path / 'repo')}"]
    assert main(args) == 0, capsys.readouterr()
    data = json.loads(capsys.readouterr().out)["data"]
    assert data["status"] == "DRY_RUN_OK" and data["dry_run"] is True
    assert data["nodes"] >= 1 and data["command"] and "NODE_RANK" in data["variables"]
    assert "RANK" not in data["variables"] and isinstance(data["would_install"], list)


def test_a_git_pin_archives_the_commit_and_a_dirty_tree_with_a_branch_is_refused(tmp_path):
    """git.branch takes the branch's head with git archive; uncommitted changes refuse a branch pin, and a
    commit pin leaves them out."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text("v1")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    assert (Snapshot(repo, {"branch": "main"}).take(tmp_path / "a") / "train.py").read_text() == "v1"
    (repo / "train.py").write_text("v2, not committed")
    with pytest.raises(JobFileError, match="has uncommitted changes"):
        Snapshot(repo, {"branch": "main"}).check()
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
    assert (Snapshot(repo, {"commit": done.stdout.strip()}).take(tmp_path / "b") / "train.py").read_text() == "v1"
    with pytest.raises(JobFileError, match="git rev-parse"):
        Snapshot(repo, {"branch": "nobranch"}).check()
