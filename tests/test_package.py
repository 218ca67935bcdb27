"""The built wheel works on its own: installed (not editable) into a fresh virtualenv, it loads in a kernel of that
environment, runs a 2-rank CPU call, and brings the MLflow link's Jupyter server configuration along."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import CellResult, kernel_env
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parent.parent
#: What the wheel is built from; copied so the build leaves nothing (build/, *.egg-info) in the checkout.
SOURCES = ("pyproject.toml", "README.md", "air_magic", "jupyter-config")
PROXY_CONFIG = Path("etc/jupyter/jupyter_server_config.d/air_magic_mlflow_proxy.json")

pytestmark = pytest.mark.slow


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def outside_env() -> dict[str, str]:
    """This test's environment with no PYTHONPATH entry that holds an air_magic (the checkout), so only the
    installed wheel can be imported; other entries stay (where packages come from PYTHONPATH, as on a GPU node)."""
    env = dict(os.environ)
    kept = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "air_magic").exists()]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtualenv with the built wheel installed (no editable install, no checkout on sys.path).

    Its own site-packages come first; the test environment's site-packages follow through a .pth line, for
    torch, MLflow and Jupyter, which would otherwise take minutes to install (its .pth hooks, the editable
    install of air_magic among them, are not run).
    """
    tmp = tmp_path_factory.mktemp("package")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", tmp / "dist", src, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("air_magic-*.whl")

    env_dir = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", env_dir, cwd=tmp)
    py = env_dir / "bin" / "python"
    own_site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp).strip())
    (own_site / "_test_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp)
    run(py, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3", cwd=tmp, env=outside_env())
    return env_dir


def site_packages(env_dir: Path) -> str:
    return str(env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages")


def test_wheel_is_what_gets_imported(venv, tmp_path):
    """The venv imports air_magic from its own site-packages, and its metadata version is air_magic.__version__."""
    probe = (
        "import importlib.metadata, json, air_magic;"
        "print(json.dumps([air_magic.__file__, air_magic.__version__, importlib.metadata.version('air_magic')]))"
    )
    path, version, metadata = json.loads(run(venv / "bin" / "python", "-c", probe, cwd=tmp_path, env=outside_env()))
    assert path.startswith(site_packages(venv) + os.sep)
    assert version == metadata
    source = (ROOT / "air_magic" / "__init__.py").read_text()
    assert re.search(rf'^__version__ = "{re.escape(version)}"$', source, re.MULTILINE)
    assert (Path(path).parent / "py.typed").exists()


def test_mlflow_proxy_configuration_is_installed(venv, tmp_path):
    """The wheel installs the Jupyter server configuration that enables jupyter-server-proxy (the MLflow link's
    route), where a Jupyter server of that environment reads it."""
    config = venv / PROXY_CONFIG
    assert json.loads(config.read_text())["ServerApp"]["jpserver_extensions"]["jupyter_server_proxy"] is True
    probe = "import json; from jupyter_core.paths import jupyter_config_path; print(json.dumps(jupyter_config_path()))"
    paths = json.loads(run(venv / "bin" / "python", "-c", probe, cwd=tmp_path, env=outside_env()))
    assert str(venv / "etc" / "jupyter") in paths


def test_kernel_of_the_venv_runs_two_ranks(venv, tmp_path):
    """`%load_ext air_magic` in a kernel of the venv, then a 2-rank CPU call whose ranks import the installed
    air_magic, and a %%distributed cell."""
    (tmp_path / "runs").mkdir()
    km = KernelManager(
        kernel_name="python3",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(venv / "share" / "jupyter" / "kernels")]),
    )
    env = {**outside_env(), **kernel_env(tmp_path)}
    km.start_kernel(cwd=str(tmp_path), env=env, extra_arguments=["--HistoryManager.enabled=False"])
    kc = km.client()
    kc.start_channels(hb=False)  # as tests/helpers.Kernel: the manager knows whether the kernel lives

    def execute(code: str) -> CellResult:
        out = CellResult()
        out.reply = kc.execute_interactive(code, timeout=240, output_hook=out.add, allow_stdin=False)["content"]
        return out.check()

    try:
        kc.wait_for_ready(timeout=60)
        assert km.kernel_spec is not None and km.kernel_spec.argv[0] == str(venv / "bin" / "python")
        execute("%load_ext air_magic")
        out = execute(
            "import json, air_magic\n"
            "from air_magic import distributed\n"
            "@distributed(2)\n"
            "def where():\n"
            "    import os, air_magic, torch, torch.distributed as dist\n"
            "    dist.init_process_group('gloo')\n"
            "    t = torch.ones(1)\n"
            "    dist.all_reduce(t)\n"
            "    return air_magic.__file__, int(os.environ['RANK']), t.item()\n"
            "print('RESULT', json.dumps([air_magic.__file__, where.distributed()]))\n"
        )
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
        kernel_file, ranks = json.loads(line.removeprefix("RESULT "))
        assert kernel_file.startswith(site_packages(venv) + os.sep)
        assert [rank for _, rank, _ in ranks] == [0, 1]
        assert all(path == kernel_file and total == 2.0 for path, _, total in ranks)
        cell = execute("%%distributed --gpus 2 --no-mlflow --out ranks\nimport os\nint(os.environ['RANK'])")
        assert cell.result == "[0, 1]"
    finally:
        pid = km.provisioner.process.pid  # type: ignore[union-attr]
        children = psutil.Process(pid).children(recursive=True) if psutil.pid_exists(pid) else []
        kc.stop_channels()
        km.shutdown_kernel(now=False)
        _, alive = psutil.wait_procs(children, timeout=15)
        for proc in alive:
            proc.kill()
    assert not alive, f"the kernel's shutdown left {alive}"
