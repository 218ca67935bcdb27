"""The cached environment a workload's missing `environment.dependencies` are installed into, layered over yours.

One directory per dependency list, `$XDG_CACHE_HOME/air_magic/envs/<key>` (default `~/.cache`), keyed by this
Python's version, `sys.prefix`, the normalized entries (flags included), the content of the wheels and
requirements files they name, and what this environment lacks of them. It is a virtual environment made from this
interpreter (`python -m venv --without-pip`) whose site-packages holds a `.pth` file that adds your environment's
site-packages after its own: its `python` sees your packages, and pip run by that `python` (your pip, seen through
the `.pth`, else the one Python bundles) finds them installed, so only what your environment lacks is installed,
into the layer, and never into your environment (pip does not uninstall outside the environment it runs in). uv is
not used: it counts only an interpreter's own site-packages as installed, so it would install your packages again
(torch included) into the layer.

It is made once, under a file lock (a second run waits for the first), in place (pip writes the layer's path into
the scripts it installs, so it cannot be built under another name and renamed), with `.complete` written last; a
directory without it (a build that died) is made again. pip's output is the layer's `install.log` (copied into each
run's directory); a failed install is a JobFileError with pip's last lines, the layer removed and the log kept
beside it. Not for: reading the list (cli/dependencies.py), the command's environment (cli/node.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import dependencies
from .schema import JobFileError

#: Written last into a layer that is whole.
COMPLETE = ".complete"
#: pip's output, in the layer (and `<key>.failed.log` beside it when the install failed).
LOG = "install.log"
#: The file in the layer's site-packages that adds your environment's site-packages after the layer's own.
PTH = "_air_magic_base_env.pth"
#: Lines of pip's output a failed install's error shows.
TAIL_LINES = 15


def envs_root() -> Path:
    """`$XDG_CACHE_HOME/air_magic/envs`, else `~/.cache/air_magic/envs` (not made here)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "air_magic" / "envs"


def base_site_dirs() -> list[str]:
    """This environment's site-packages directories (and the user site, when this Python reads it)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _digest(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError as exc:
        raise JobFileError(f"environment.dependencies: {path}: {exc.strerror or exc}") from None


def key(entries: list[dependencies.Entry], lacking: list[str]) -> str:
    """The layer's key: this Python, its environment, the normalized entries, their files' contents, the lacking."""
    files = {str(e.path): _digest(e.path) for e in entries if e.path is not None}
    data = {
        "python": sys.version,
        "prefix": sys.prefix,
        "entries": [e.text for e in entries],
        "files": files,
        "lacking": sorted(lacking),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Layer:
    """The cached environment of one dependency list: `installs` are pip's argument lists (run in `cwd`)."""

    path: Path
    lacking: tuple[str, ...]
    installs: tuple[tuple[str, ...], ...]
    cwd: Path

    @classmethod
    def of(cls, raw: list[str], base: Path, lacking: list[str]) -> Layer:
        entries = dependencies.parse(raw, base)
        installs = tuple(tuple(args) for args in dependencies.pip_installs(raw, base))
        return cls(envs_root() / key(entries, lacking), tuple(lacking), installs, base)

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    @property
    def site_packages(self) -> Path:
        scheme = "venv" if "venv" in sysconfig.get_scheme_names() else "posix_prefix"
        return Path(sysconfig.get_path("purelib", scheme, vars={"base": str(self.path), "platbase": str(self.path)}))

    @property
    def log(self) -> Path:
        return self.path / LOG

    @property
    def cached(self) -> bool:
        return (self.path / COMPLETE).exists()

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """PATH and PYTHONPATH of `base` with the layer first: `python` is the layer's, and any Python (torchrun's,
        your environment's) sees the layer's packages before its own."""
        return {
            "PATH": os.pathsep.join([str(self.bin), *filter(None, [base.get("PATH")])]),
            "PYTHONPATH": os.pathsep.join([str(self.site_packages), *filter(None, [base.get("PYTHONPATH")])]),
        }

    def on_sys_path(self) -> None:
        """The layer's site-packages on this process's sys.path, before this environment's (for a function's
        import here, and the ranks, which get this sys.path)."""
        where = str(self.site_packages)
        if where in sys.path:
            return
        sites = set(base_site_dirs())
        at = next((i for i, p in enumerate(sys.path) if p in sites), len(sys.path))
        sys.path.insert(at, where)

    def describe(self) -> dict[str, object]:
        return {"path": str(self.path), "cached": self.cached}

    def ensure(self, say: Callable[[str], None]) -> None:
        """Make the layer unless it is whole already, saying which in one line; JobFileError if pip fails."""
        if self.cached:
            say(f"air-magic: using the cached environment {self.path}")
            return
        root = self.path.parent
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(root / f"{self.path.name}.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(f"air-magic: waiting for another run that makes the cached environment {self.path}")
                fcntl.flock(lock, fcntl.LOCK_EX)
            if self.cached:
                say(f"air-magic: using the cached environment {self.path}")
                return
            say(f"air-magic: installing {len(self.lacking)} package(s) into the cached environment {self.path}")
            self._build()

    def _build(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)  # a build that died left it incomplete
        self.path.mkdir(mode=0o700)
        with open(self.log, "w") as log:
            log.write(f"# missing from {sys.prefix}: {', '.join(self.lacking)}\n")
            steps = [[sys.executable, "-m", "venv", "--without-pip", str(self.path)]]
            for args in self.installs:
                steps.append([*self._pip(), "install", "--disable-pip-version-check", "--no-input", *args])
            for i, cmd in enumerate(steps):
                if i == 1:
                    self._link_base()
                log.write(f"$ {' '.join(cmd)}\n")
                log.flush()
                code = subprocess.run(
                    cmd,
                    check=False,
                    cwd=self.cwd,
                    env=_pip_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ).returncode
                if code != 0:
                    log.close()
                    self._failed(cmd, code)
        (self.path / COMPLETE).write_text(json.dumps({"made": time.time(), "lacking": list(self.lacking)}))

    def _link_base(self) -> None:
        lines = [f"import site; site.addsitedir({d!r})" for d in base_site_dirs()]
        self.site_packages.mkdir(parents=True, exist_ok=True)
        (self.site_packages / PTH).write_text("\n".join(lines) + "\n")

    def _pip(self) -> list[str]:
        """pip run by the layer's python: yours (importable there through the .pth), else the one Python bundles."""
        import importlib.util

        if importlib.util.find_spec("pip") is not None:
            return [str(self.python), "-m", "pip"]
        import ensurepip

        bundled = sorted((Path(ensurepip.__file__).parent / "_bundled").glob("pip-*.whl"))
        if not bundled:
            raise JobFileError(
                f"environment.dependencies: {', '.join(self.lacking)} would be installed with pip, and neither "
                f"{sys.prefix} nor this Python has it; install pip into this environment, or the dependencies"
            )
        return [str(self.python), str(bundled[-1] / "pip")]

    def _failed(self, cmd: list[str], code: int) -> None:
        kept = self.path.parent / f"{self.path.name}.failed.log"
        shutil.move(self.log, kept)
        shutil.rmtree(self.path, ignore_errors=True)
        tail = kept.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        what = "making the virtual environment" if "venv" in cmd else "pip install"
        raise JobFileError(
            f"environment.dependencies: installing {', '.join(self.lacking)} failed ({what} exited with code {code}); "
            f"nothing was started. Its last lines:\n" + "\n".join(f"  {line}" for line in tail) + f"\nAll of it: {kept}"
        )


def _pip_env() -> dict[str, str]:
    """This environment, without the pip settings that would install somewhere else than the layer."""
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_TARGET", "PIP_PREFIX", "PIP_ROOT", "PIP_USER")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env
