"""The %%distributed cell magic and the IPython extension, driven through nbclient in real kernels."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

from helpers import REAL_NODE, ROOT, ErrorOutput, gpu_count, leftover_processes


@dataclass
class Ran(ErrorOutput):
    """What one notebook cell produced, as nbclient recorded it."""

    cell: Any
    reply: dict = field(default_factory=dict)

    def _text(self, name: str) -> str:
        return "".join(o["text"] for o in self.cell.outputs if o["output_type"] == "stream" and o["name"] == name)

    @property
    def stdout(self) -> str:
        return self._text("stdout")

    @property
    def stderr(self) -> str:
        return self._text("stderr")

    @property
    def result(self) -> str | None:
        found = [o["data"]["text/plain"] for o in self.cell.outputs if o["output_type"] == "execute_result"]
        return found[-1] if found else None

    @property
    def error(self) -> Any:
        found = [o for o in self.cell.outputs if o["output_type"] == "error"]
        return found[-1] if found else None

    def check(self) -> "Ran":
        assert self.error is None and "Error" not in self.stderr, (
            f"cell failed: {self.ename}\n{self.traceback}\nstderr:\n{self.stderr}\nstdout:\n{self.stdout}"
        )
        return self


class Notebook:
    """A notebook that grows one cell at a time, each executed by nbclient in one real kernel."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.nb = nbformat.v4.new_notebook()
        self.replies: list[dict] = []
        self.client = NotebookClient(
            self.nb,
            kernel_name="python3",
            timeout_func=lambda cell: cell.metadata.get("timeout", 240),
            interrupt_on_timeout=True,  # a cell that outlives its timeout gets a kernel interrupt
            allow_errors=True,
            resources={"metadata": {"path": str(cwd)}},
            extra_arguments=["--HistoryManager.enabled=False"],
            on_cell_executed=lambda cell, cell_index, execute_reply: self.replies.append(execute_reply),
        )
        kernel_env = dict(os.environ)
        kernel_env.update(env)
        kernel_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), kernel_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.client.km = self.client.create_kernel_manager()
        self.client.start_new_kernel(env=kernel_env)
        self.client.start_new_kernel_client()

    @property
    def pid(self) -> int:
        return self.client.km.provisioner.process.pid

    def run(self, source: str, timeout: float | None = None) -> Ran:
        cell = nbformat.v4.new_code_cell(source)
        if timeout is not None:
            cell.metadata["timeout"] = timeout
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        reply = self.replies[-1]["content"] if self.replies else {}
        return Ran(cell, reply)

    def value(self, expression: str) -> str:
        """The repr of an expression evaluated in the kernel."""
        return self.run(f"print(repr(({expression})))").check().stdout.strip()

    def shutdown(self) -> None:
        children = psutil.Process(self.pid).children(recursive=True) if psutil.pid_exists(self.pid) else []
        self.client._cleanup_kernel()
        gone, alive = psutil.wait_procs(children, timeout=15)
        for proc in alive:
            proc.kill()
        assert not alive, f"kernel shutdown left {alive}"


def kernel_env(workdir: Path) -> dict[str, str]:
    """Plain-text display (these tests read `[rank N]` lines), private runs and MLflow store."""
    return {
        "AIR_MAGIC_RUNS_DIR": str(workdir / "runs"),
        "AIR_MAGIC_DISPLAY": "text",
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/mlflow.db",
    }


@pytest.fixture(scope="module")
def nb(workdir):
    """A notebook in a fresh kernel where air_magic has not been loaded yet."""
    notebook = Notebook(workdir, kernel_env(workdir))
    yield notebook
    notebook.shutdown()


@pytest.fixture
def loaded(nb):
    nb.run("%load_ext air_magic").check()
    return nb


def run_dirs(workdir: Path) -> set[str]:
    return {p.name for p in (workdir / "runs").iterdir() if p.is_dir()}


def supervisor_pid(nb: Notebook) -> int | None:
    nb.run("from air_magic.launch.local import local_launcher as _launcher").check()
    pid = int(nb.value("_launcher().supervisor_pid or -1"))
    return None if pid == -1 else pid


def test_load_twice_is_harmless_and_unload_removes_the_magic_and_supervisor(nb):
    """%load_ext registers %%distributed once however often it runs; %unload_ext removes it and stops the supervisor."""
    assert "Cell magic `%%distributed` not found" in nb.run("%%distributed\n1").stderr
    nb.run("%load_ext air_magic").check()
    second = nb.run("%load_ext air_magic\nimport air_magic\nair_magic.load_ipython_extension(get_ipython())").check()
    assert "already loaded" in second.stdout
    count = "sum(type(c).__name__ == 'DistributedMagics' for c in get_ipython().configurables)"
    assert nb.value(count) == "1"
    assert nb.run("%%distributed --gpus 2\nimport os\nint(os.environ['RANK'])").check().result == "[0, 1]"
    sup = supervisor_pid(nb)
    assert sup is not None and psutil.pid_exists(sup)

    nb.run("%unload_ext air_magic").check()
    assert nb.value("'distributed' in get_ipython().magics_manager.magics['cell']") == "False"
    assert nb.value(count) == "0"
    assert "Cell magic `%%distributed` not found" in nb.run("%%distributed\n1").stderr
    assert not psutil.pid_exists(sup) or psutil.Process(sup).status() == psutil.STATUS_ZOMBIE
    assert supervisor_pid(nb) is None

    nb.run("%load_ext air_magic").check()
    assert nb.run("%%distributed --num-accelerators 2\nimport os\nint(os.environ['RANK'])").check().result == "[0, 1]"


def test_help_lists_every_option(loaded):
    """`%%distributed?` shows the docstring and every option."""
    out = loaded.run("%%distributed?").check()
    pages = [p["data"]["text/plain"] for p in out.reply.get("payload", []) if p.get("source") == "page"]
    assert pages, f"no help page in the reply: {out.reply}"
    text = re.sub(r"\x1b\[[0-9;]*m", "", pages[0])
    for option in [
        "--gpus N",
        "--num-accelerators N",
        "--accelerator-type T",
        "--timeout S",
        "--no-mlflow",
        "--out NAME",
    ]:
        assert option in text, option
    assert "last expression" in text


@pytest.mark.parametrize(
    "line, message",
    [
        ("--bogus", "unrecognized arguments: --bogus"),
        ("--gpus two", "argument --gpus/--num-accelerators: expected a whole number"),
        ("--gpus 0", "needs at least 1 worker"),
        ("--timeout 0", "--timeout none for no limit"),
        ("--timeout soon", "expected seconds"),
        ("--out 1x", "'1x' is not a valid Python variable name"),
        ("--gpus 2 extra", "unrecognized arguments: extra"),
    ],
)
def test_bad_option_prints_usage_and_runs_nothing(loaded, workdir, line, message):
    """A bad option gives a UsageError with the problem, and no worker starts."""
    before = run_dirs(workdir)
    out = loaded.run(f"%%distributed {line}\nprint('cell ran')")
    assert "UsageError" in out.stderr and message in out.stderr, out.stderr
    assert out.reply["status"] == "error"
    assert "cell ran" not in out.stdout
    assert run_dirs(workdir) == before


def test_setting_that_does_not_fit_the_node_fails_before_anything_starts(loaded, workdir):
    """An accelerator type the node lacks is a ConfigurationError naming what was detected; nothing starts."""
    before = run_dirs(workdir)
    out = loaded.run("%%distributed --accelerator-type GPU_2xH100\nprint('cell ran')")
    assert out.ename == "ConfigurationError" and "none were detected" in out.traceback
    assert run_dirs(workdir) == before


def test_cell_runs_with_the_notebook_globals_it_uses_and_returns_per_rank_values(loaded):
    """Functions, classes, constants and modules from earlier cells reach every rank; the last expression comes back per rank."""
    loaded.run(
        "import json as js\n"
        "SCALE = 10\n"
        "def inner(x):\n    return x + 1\n"
        "def helper(x):\n    return inner(x) * SCALE\n"
        "class Point:\n    def __init__(self, x):\n        self.x = x\n    def norm(self):\n        return abs(self.x)\n"
    ).check()
    out = loaded.run(
        "%%distributed --gpus 2 --out ranks --no-mlflow\n"
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} sum {t.item()}')\n"
        "(dist.get_rank(), helper(dist.get_rank()), Point(-3).norm(), t.item(), js.__file__)\n"
    ).check()
    expected = "[(0, 10, 3, 3.0, js.__file__), (1, 20, 3, 3.0, js.__file__)]"
    assert out.result is not None and loaded.value(f"ranks == {expected}") == "True", out.result
    assert "[rank 0] rank 0 sum 3.0" in out.stdout and "[rank 1] rank 1 sum 3.0" in out.stdout
    assert loaded.value(f"ranks == Out[{out.cell.execution_count}]") == "True"
    assert loaded.value("type(ranks).__name__, len(ranks)") == "('list', 2)"
    assert loaded.value("get_ipython().magics_manager.registry['DistributedMagics'].last_result.spec.mlflow") == "False"

    quiet = loaded.run("%%distributed --gpus 2 --out quiet\nimport os\nos.environ['WORLD_SIZE'];").check()
    assert quiet.result is None, "a trailing semicolon shows no result"
    assert loaded.value("quiet") == "['2', '2']"
    no_value = loaded.run("%%distributed --gpus 2\nx = 1").check()
    assert no_value.result == "[None, None]"
    assert loaded.value("get_ipython().magics_manager.registry['DistributedMagics'].last_result.spec.mlflow") == "True"


def test_unpicklable_global_is_named_before_anything_starts(loaded, workdir):
    """A global the cell uses that cannot be pickled is named in a SerializationError and no worker starts."""
    loaded.run("import threading\nlock = threading.Lock()\nharmless = 1").check()
    before = run_dirs(workdir)
    out = loaded.run("%%distributed --gpus 2\nprint(harmless)\nlock.locked()")
    assert out.ename == "SerializationError", out.traceback
    assert "global 'lock'" in out.traceback and "harmless" not in out.error["evalue"]
    assert run_dirs(workdir) == before


def test_cell_error_shows_original_exception_the_rank_and_the_cell_lines(loaded):
    """A raising cell gives the original exception type, the rank, and a traceback through the cell's own lines."""
    loaded.run(
        "class TrainingDiverged(Exception):\n    pass\n"
        "def check_loss(loss):\n    if loss != loss:\n        raise TrainingDiverged('loss is nan')\n"
    ).check()
    out = loaded.run(
        "%%distributed --gpus 2\n"
        "import os\n"
        "loss = float('nan') if os.environ['RANK'] == '1' else 1.0\n"
        "print('checking', flush=True)\n"
        "check_loss(loss)\n"
    )
    assert out.ename == "TrainingDiverged", out.traceback
    assert "rank 1 of 2" in out.traceback and "loss is nan" in out.traceback
    count = out.cell.execution_count
    cell_file = loaded.value(f"[n for n, c in get_ipython().compile._filename_map.items() if c == {count}][0]").strip(
        "'"
    )
    helper_count = count - 1
    helper_file = loaded.value(
        f"[n for n, c in get_ipython().compile._filename_map.items() if c == {helper_count}][0]"
    ).strip("'")
    assert f'File "{cell_file}", line 5, in <module>\n    check_loss(loss)' in out.traceback, out.traceback
    assert f'File "{helper_file}", line 5, in check_loss\n    raise TrainingDiverged' in out.traceback, out.traceback
    assert "<dynamic-code>" not in out.traceback


def test_syntax_error_names_the_cell_line_and_nothing_starts(loaded, workdir):
    """A syntax error in the cell is raised in the notebook at the cell's line number, before any worker starts."""
    before = run_dirs(workdir)
    out = loaded.run("%%distributed --gpus 2\nx = 1\ny = (\n")
    assert out.ename == "SyntaxError" and "line 3" in out.traceback, out.traceback
    shell = loaded.run("%%distributed --gpus 2\n!ls\n")
    assert shell.ename == "SyntaxError" and "plain Python" in shell.traceback
    assert run_dirs(workdir) == before


def test_interrupt_during_a_cell_stops_every_worker_and_the_next_cell_runs(loaded):
    """A kernel interrupt sent while a %%distributed cell runs gives KeyboardInterrupt, ends its workers, and the next cell works."""
    before = {p.pid for p in psutil.process_iter()}
    # nbclient interrupts the kernel when a cell outlives its timeout, as the stop button does
    out = loaded.run(
        "%%distributed --gpus 2 --timeout none\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)\n",
        timeout=15,
    )
    assert out.ename == "KeyboardInterrupt", out.traceback
    assert "[rank 0] sleeping" in out.stdout and "[rank 1] sleeping" in out.stdout
    assert leftover_processes(before, wait=10, kind="job") == []
    assert loaded.run("%%distributed --gpus 2\nimport os\nint(os.environ['RANK'])").check().result == "[0, 1]"


CONFIG_OVERRIDES = """
c.DistributedMagics.default_timeout = 4
c.DistributedMagics.default_accelerator_type = "CPU"
c.DistributedMagics.default_num_accelerators = 3
c.DistributedMagics.mlflow = False
"""


def test_kernel_config_file_loads_the_extension_and_sets_defaults(workdir, tmp_path):
    """jupyter-config/ipython_kernel_config.py loads air_magic in a new kernel; c.DistributedMagics.* set the defaults."""
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    shutil.copy(ROOT / "jupyter-config" / "ipython_kernel_config.py", profile / "ipython_kernel_config.py")
    with open(profile / "ipython_kernel_config.py", "a") as f:
        f.write(CONFIG_OVERRIDES)
    notebook = Notebook(workdir, {**kernel_env(workdir), "IPYTHONDIR": str(tmp_path / "ipython")})
    try:
        out = notebook.run("%%distributed\nimport os\nint(os.environ['WORLD_SIZE'])").check()
        assert out.result == "[3, 3, 3]"
        spec = "get_ipython().magics_manager.registry['DistributedMagics'].last_result.spec"
        assert notebook.value(f"{spec}.timeout, {spec}.accelerator_type, {spec}.mlflow") == "(4.0, 'CPU', False)"
        magics = "get_ipython().magics_manager.registry['DistributedMagics']"
        assert notebook.value(f"{magics}.settings('--timeout none --gpus 2').timeout") == "None"
        assert notebook.value(f"{magics}.settings('--timeout 60').num_accelerators") == "3"

        slow = notebook.run("%%distributed --gpus 2\nimport time\ntime.sleep(120)")
        assert slow.ename == "DistributedTimeoutError" and "timeout of 4 s" in slow.traceback, slow.traceback
        assert "--timeout S" in slow.traceback

        notebook.run("%config DistributedMagics.default_timeout = None").check()
        assert notebook.value(f"{magics}.settings('').timeout") == "None"
        bad = notebook.run("%config DistributedMagics.default_timeout = 0")
        assert "default_timeout" in bad.traceback + bad.stderr and "more than 0" in bad.traceback + bad.stderr
    finally:
        notebook.shutdown()


def test_black_with_the_project_settings_formats_distributed_cells_as_python():
    """pyproject.toml's python_cell_magics makes black format the body of a %%distributed cell, which it skips otherwise."""
    import black

    config = black.parse_pyproject_toml(str(ROOT / "pyproject.toml"))
    mode = black.Mode(is_ipynb=True, python_cell_magics=set(config["python_cell_magics"]))
    cell = "%%distributed --gpus 2\nx=[1,2 ,3]\nx"
    assert black.format_cell(cell, fast=False, mode=mode) == "%%distributed --gpus 2\nx = [1, 2, 3]\nx"
    with pytest.raises(black.NothingChanged):
        black.format_cell(cell, fast=False, mode=black.Mode(is_ipynb=True))


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="needs an NVIDIA GPU")
def test_cell_all_reduces_over_nccl_on_every_gpu_without_cuda_in_the_kernel(loaded):
    """On a GPU node a plain %%distributed cell runs one rank per GPU over NCCL; the kernel never initializes CUDA."""
    gpus = gpu_count()
    loaded.run("import os as _os; _os.environ.update(%r)" % REAL_NODE).check()  # see the node's real GPUs
    try:
        out = loaded.run(
            "%%distributed --no-mlflow\n"
            "import os, torch, torch.distributed as dist\n"
            "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
            "dist.init_process_group('nccl')\n"
            "t = torch.ones(1, device='cuda') * (dist.get_rank() + 1)\n"
            "dist.all_reduce(t)\n"
            "(dist.get_rank(), torch.cuda.current_device(), t.item())\n"
        ).check()
        total = float(gpus * (gpus + 1) // 2)
        assert loaded.value(f"Out[{out.cell.execution_count}] == [(r, r, {total}) for r in range({gpus})]") == "True", (
            out.result
        )
        assert (
            loaded.value("'torch' not in __import__('sys').modules or not __import__('torch').cuda.is_initialized()")
            == "True"
        )
    finally:
        loaded.run("_os.environ['AIR_MAGIC_FORCE_CPU'] = '1'").check()
