"""`code_source: {type: snapshot, snapshot: {...}}`: the code a workload runs, copied when it is submitted.

`root_path(text, base)` finds the directory the file names (relative to the YAML file unless absolute; `~`,
`$VARS` and a leading `project_root/` as the runtime reads them). `Snapshot.take(dest)` copies it into the run
directory, so edits made after `run` returns change neither the run nor its retries:
- without `git:`, the working tree as it is: `.git` and macOS `._*` files left out, the `.gitignore` at the
  root honoured (its negations dropped, `**` simplified, as the runtime does);
- with `git.branch`, that branch's local head through `git archive` (a tree with uncommitted changes is
  refused, as the runtime refuses it); with `git.commit`, that commit, which must exist locally;
- `include_paths`: only those paths of the root, each of which must exist.
The runs directory (`AIR_MAGIC_RUNS_DIR`), where the copy goes, is never copied when it lies inside the root.
Not for: the fields' form (cli/schema.py).
"""

from __future__ import annotations

import fnmatch
import io
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..launch.files.rundir import runs_root
from .schema import JobFileError


def root_path(text: str, base: Path) -> Path:
    """The directory `text` names, read as the runtime reads `root_path`; JobFileError if there is none."""
    expanded = os.path.expandvars(os.path.expanduser(text))
    expanded = expanded.removeprefix("project_root/")
    root = (base / expanded).resolve()
    if not root.is_dir():
        raise JobFileError(f"code_source.snapshot.root_path: no such directory: {root} (from {text!r})")
    return root


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise JobFileError(f"git {' '.join(args)} in {root} failed: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


def _ignore_rules(root: Path) -> list[tuple[str, bool, bool]]:
    """(pattern, anchored, directories only) of the root's .gitignore; negations dropped."""
    try:
        lines = (root / ".gitignore").read_text(errors="replace").splitlines()
    except OSError:
        return []
    rules = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        line = line.replace("**/", "").replace("/**", "")
        dirs = line.endswith("/")
        line = line.strip("/")
        if line:
            rules.append((line, "/" in line, dirs))
    return rules


def _ignored(rel: str, is_dir: bool, rules: list[tuple[str, bool, bool]]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    if name == ".git" or name.startswith("._"):
        return True
    for pattern, anchored, dirs in rules:
        if dirs and not is_dir:
            continue
        if fnmatch.fnmatch(rel if anchored else name, pattern):
            return True
    return False


@dataclass(frozen=True)
class Snapshot:
    """The code of a workload: `root`, at `git` (branch or commit) if given, limited to `include_paths`."""

    root: Path
    git: dict[str, Any] | None = None
    include_paths: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.root.name

    def revision(self) -> str | None:
        """The commit a git pin names (checked now); None without one."""
        if not self.git:
            return None
        top = _git(self.root, "rev-parse", "--show-toplevel")
        if "branch" in self.git:
            sha = _git(self.root, "rev-parse", "--verify", f"refs/heads/{self.git['branch']}^{{commit}}")
            if _git(self.root, "status", "--porcelain", "--untracked-files=no"):
                raise JobFileError(
                    f"code_source.snapshot.git.branch: {top} has uncommitted changes; commit or stash them, or pin "
                    "git.commit (uncommitted changes are then left out)"
                )
            return sha
        return _git(self.root, "rev-parse", "--verify", f"{self.git['commit']}^{{commit}}")

    def describe(self) -> str:
        what = f"{self.root}"
        if self.git:
            what += f" at git {'branch' if 'branch' in self.git else 'commit'} "
            what += str(self.git.get("branch") or self.git.get("commit"))
        else:
            what += " (the working tree, .gitignore honoured)"
        if self.include_paths:
            what += f", only {', '.join(self.include_paths)}"
        return what

    def check(self) -> None:
        """What `take` would refuse, without copying: a git pin that does not resolve, a missing include path."""
        sha = self.revision()
        for entry in self.include_paths:
            if sha is None and not (self.root / entry).exists():
                raise JobFileError(f"code_source.snapshot.include_paths: {entry!r} does not exist in {self.root}")
            if sha is not None:
                prefix = _git(self.root, "rev-parse", "--show-prefix")
                try:
                    _git(self.root, "cat-file", "-e", f"{sha}:{prefix}{entry}")
                except JobFileError:
                    raise JobFileError(
                        f"code_source.snapshot.include_paths: {entry!r} does not exist at {sha[:12]}"
                    ) from None

    def archive(self) -> bytes:
        """The code as a gzipped tar archive, taken now (for nodes that are other machines)."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="air_magic-snapshot-") as tmp:
            taken = self.take(Path(tmp))
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
                tar.add(taken, arcname=taken.name)
        return buffer.getvalue()

    def take(self, dest: Path) -> Path:
        """Copy the code into `dest`/<root's name>; that directory."""
        self.check()
        target = dest / self.name
        target.mkdir(parents=True, mode=0o700)
        sha = self.revision()
        if sha is not None:
            prefix = _git(self.root, "rev-parse", "--show-prefix")
            done = subprocess.run(
                [
                    "git",
                    "-C",
                    str(self.root),
                    "archive",
                    "--format=tar",
                    f"{sha}:{prefix}" if prefix else sha,
                    *self.include_paths,
                ],
                capture_output=True,
                check=False,
            )
            if done.returncode != 0:
                raise JobFileError(f"git archive of {sha[:12]} failed: {done.stderr.decode(errors='replace')}")
            with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
                tar.extractall(target, filter="data")
            return target
        rules = _ignore_rules(self.root)
        own = {runs_root().resolve(), target.resolve()}  # air_magic's runs, this one's copy among them: never code
        starts = [self.root / p for p in self.include_paths] or [self.root]
        for start in starts:
            if start.is_file():
                (target / start.relative_to(self.root)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(start, target / start.relative_to(self.root))
                continue
            for folder, dirs, files in os.walk(start):
                rel_dir = Path(folder).relative_to(self.root)
                dirs[:] = [
                    d
                    for d in dirs
                    if not _ignored((rel_dir / d).as_posix(), True, rules) and (Path(folder) / d).resolve() not in own
                ]
                (target / rel_dir).mkdir(parents=True, exist_ok=True)
                for name in files:
                    rel = (rel_dir / name).as_posix()
                    if not _ignored(rel, False, rules):
                        shutil.copy2(Path(folder) / name, target / rel, follow_symlinks=False)
        return target


def of(source: dict[str, Any] | None, base: Path) -> Snapshot | None:
    """The snapshot a file's `code_source` asks for (paths relative to `base`, the YAML's directory); None without."""
    if not source:
        return None
    snap = source["snapshot"]
    return Snapshot(root_path(snap["root_path"], base), snap.get("git"), tuple(snap.get("include_paths") or ()))
