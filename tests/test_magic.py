"""The %%distributed cell magic and the IPython extension, in real kernels."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import psutil
import pytest
from helpers import REAL_NODE, ROOT, Kernel, gpu_count, leftover_processes

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fresh_kernel(new_module_kernel):
    """A notebook in a fresh kernel where air_magic has not been loaded yet."""
    return new_module_kernel()


@pytest.fixture
def loaded(fresh_kernel):
    fresh_kernel.execute("%load_ext air_magic").check(clean_stderr=True)
    return fresh_kernel


def run_dirs(workdir: Path) -> set[str]:
    """The calls' run directories (the leases' private directory beside them is not one)."""
    return {p.name for p in (workdir / "runs").iterdir() if p.is_dir() and not p.name.startswith(".")}


def supervisor_pid(fresh_kernel: Kernel) -> int | None:
    fresh_kernel.execute("from air_magic.owner import owner as _owner").check(clean_stderr=True)
    pid = int(fresh_kernel.value("_owner().launchers.local.supervisor_pid or -1"))
    return None if pid == -1 else pid


def test_load_twice_is_harmless_and_unload_removes_the_magic_and_supervisor(fresh_kernel):
    """%load_ext registers %%distributed once however often it runs; %unload_ext removes it and stops the supervisor."""
    assert "Cell magic `%%distributed` not found" in fresh_kernel.execute("%%distributed\n1").stderr
    fresh_kernel.execute("%load_ext air_magic").check(clean_stderr=True)
    second = fresh_kernel.execute(
        "%load_ext air_magic\nimport air_magic\nair_magic.load_ipython_extension(get_ipython())"
    ).check(clean_stderr=True)
    assert "already loaded" in second.stdout
    count = "sum(type(c).__name__ == 'DistributedMagics' for c in get_ipython().configurables)"
    assert fresh_kernel.value(count) == "1"
    assert (
        fresh_kernel.execute("%%distributed --gpus 2\nimport os\nint(os.environ['RANK'])")
        .check(clean_stderr=True)
        .result
        == "[0, 1]"
    )
    sup = supervisor_pid(fresh_kernel)
    assert sup is not None and psutil.pid_exists(sup)

    fresh_kernel.execute("%unload_ext air_magic").check(clean_stderr=True)
    assert fresh_kernel.value("'distributed' in get_ipython().magics_manager.magics['cell']") == "False"
    assert fresh_kernel.value(count) == "0"
    assert "Cell magic `%%distributed` not found" in fresh_kernel.execute("%%distributed\n1").stderr
    assert not psutil.pid_exists(sup) or psutil.Process(sup).status() == psutil.STATUS_ZOMBIE
    assert supervisor_pid(fresh_kernel) is None

    fresh_kernel.execute("%load_ext air_magic").check(clean_stderr=True)
    assert (
        fresh_kernel.execute("%%distributed --num-accelerators 2\nimport os\nint(os.environ['RANK'])")
        .check(clean_stderr=True)
        .result
        == "[0, 1]"
    )


def test_help_lists_every_option(loaded):
    """`%%distributed?` shows the docstring and every option."""
    out = loaded.execute("%%distributed?").check(clean_stderr=True)
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
    out = loaded.execute(f"%%distributed {line}\nprint('cell ran')")
    assert "UsageError" in out.stderr and message in out.stderr, out.stderr
    assert out.reply["status"] == "error"
    assert "cell ran" not in out.stdout
    assert run_dirs(workdir) == before


def test_setting_that_does_not_fit_the_node_fails_before_anything_starts(loaded, workdir):
    """An accelerator type the node lacks is a ConfigurationError naming what was detected; nothing starts."""
    before = run_dirs(workdir)
    out = loaded.execute("%%distributed --accelerator-type GPU_2xH100\nprint('cell ran')")
    assert out.ename == "ConfigurationError" and "none were detected" in out.traceback
    assert run_dirs(workdir) == before


def test_cell_runs_with_the_notebook_globals_it_uses_and_returns_per_rank_values(loaded):
    """Functions, classes, constants and modules from earlier cells reach every rank; the last expression comes back per
    rank."""
    loaded.execute(
        "import json as js\n"
        "SCALE = 10\n"
        "def inner(x):\n    return x + 1\n"
        "def helper(x):\n    return inner(x) * SCALE\n"
        "class Point:\n    def __init__(self, x):\n        self.x = x\n    def norm(self):\n"
        "        return abs(self.x)\n"
    ).check(clean_stderr=True)
    out = loaded.execute(
        "%%distributed --gpus 2 --out ranks --no-mlflow\n"
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} sum {t.item()}')\n"
        "(dist.get_rank(), helper(dist.get_rank()), Point(-3).norm(), t.item(), js.__file__)\n"
    ).check(clean_stderr=True)
    expected = "[(0, 10, 3, 3.0, js.__file__), (1, 20, 3, 3.0, js.__file__)]"
    assert out.result is not None and loaded.value(f"ranks == {expected}") == "True", out.result
    assert "[rank 0] rank 0 sum 3.0" in out.stdout and "[rank 1] rank 1 sum 3.0" in out.stdout
    assert loaded.value(f"ranks == Out[{out.execution_count}]") == "True"
    assert loaded.value("type(ranks).__name__, len(ranks)") == "('list', 2)"
    assert loaded.value("get_ipython().magics_manager.registry['DistributedMagics'].last_result.spec.mlflow") == "False"

    quiet = loaded.execute("%%distributed --gpus 2 --out quiet\nimport os\nos.environ['WORLD_SIZE'];").check(
        clean_stderr=True
    )
    assert quiet.result is None, "a trailing semicolon shows no result"
    assert loaded.value("quiet") == "['2', '2']"
    no_value = loaded.execute("%%distributed --gpus 2\nx = 1").check(clean_stderr=True)
    assert no_value.result == "[None, None]"
    assert loaded.value("get_ipython().magics_manager.registry['DistributedMagics'].last_result.spec.mlflow") == "True"


def test_unpicklable_global_is_named_before_anything_starts(loaded, workdir):
    """A global the cell uses that cannot be pickled is named in a SerializationError and no worker starts."""
    loaded.execute("import threading\nlock = threading.Lock()\nharmless = 1").check(clean_stderr=True)
    before = run_dirs(workdir)
    out = loaded.execute("%%distributed --gpus 2\nprint(harmless)\nlock.locked()")
    assert out.ename == "SerializationError", out.traceback
    assert "global 'lock'" in out.traceback and "harmless" not in out.error["evalue"]
    assert run_dirs(workdir) == before


def test_cell_error_shows_original_exception_the_rank_and_the_cell_lines(loaded):
    """A raising cell gives the original exception type, the rank, and a traceback through the cell's own lines."""
    loaded.execute(
        "class TrainingDiverged(Exception):\n    pass\n"
        "def check_loss(loss):\n    if loss != loss:\n        raise TrainingDiverged('loss is nan')\n"
    ).check(clean_stderr=True)
    out = loaded.execute(
        "%%distributed --gpus 2\n"
        "import os\n"
        "loss = float('nan') if os.environ['RANK'] == '1' else 1.0\n"
        "print('checking', flush=True)\n"
        "check_loss(loss)\n"
    )
    assert out.ename == "TrainingDiverged", out.traceback
    assert "rank 1 of 2" in out.traceback and "loss is nan" in out.traceback
    count = out.execution_count
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
    out = loaded.execute("%%distributed --gpus 2\nx = 1\ny = (\n")
    assert out.ename == "SyntaxError" and "line 3" in out.traceback, out.traceback
    shell = loaded.execute("%%distributed --gpus 2\n!ls\n")
    assert shell.ename == "SyntaxError" and "plain Python" in shell.traceback
    assert run_dirs(workdir) == before


def test_interrupt_during_a_cell_stops_every_worker_and_the_next_cell_runs(loaded):
    """A kernel interrupt sent while a %%distributed cell runs gives KeyboardInterrupt, ends its workers, and the next
    cell works."""
    before = {p.pid for p in psutil.process_iter()}
    msg = loaded.send(
        "%%distributed --gpus 2 --timeout none\nimport time\nprint('sleeping', flush=True)\ntime.sleep(600)\n"
    )
    out = loaded.collect(msg, timeout=120, interrupt_when=lambda o: o.stdout.count("] sleeping") == 2)
    assert out.ename == "KeyboardInterrupt", out.traceback
    assert "[rank 0] sleeping" in out.stdout and "[rank 1] sleeping" in out.stdout
    assert leftover_processes(before, wait=10, kind="job") == []
    assert (
        loaded.execute("%%distributed --gpus 2\nimport os\nint(os.environ['RANK'])").check(clean_stderr=True).result
        == "[0, 1]"
    )


CONFIG_OVERRIDES = """
c.DistributedMagics.default_timeout = 4
c.DistributedMagics.default_accelerator_type = "CPU"
c.DistributedMagics.default_num_accelerators = 3
c.DistributedMagics.mlflow = False
"""


def test_kernel_config_file_loads_the_extension_and_sets_defaults(new_kernel, tmp_path):
    """jupyter-config/ipython_kernel_config.py loads air_magic in a new kernel; c.DistributedMagics.* set the
    defaults."""
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    shutil.copy(ROOT / "jupyter-config" / "ipython_kernel_config.py", profile / "ipython_kernel_config.py")
    with open(profile / "ipython_kernel_config.py", "a") as f:
        f.write(CONFIG_OVERRIDES)
    notebook = new_kernel(IPYTHONDIR=str(tmp_path / "ipython"))
    magics = "get_ipython().magics_manager.registry['DistributedMagics']"
    defaults = notebook.value(
        f"{magics}.settings('').timeout, {magics}.settings('').accelerator_type, {magics}.settings('').mlflow"
    )
    assert defaults == "(4.0, 'CPU', False)"
    # a first call on a busy machine may take longer than the configured 4 s: this cell gives its own limit
    out = notebook.execute("%%distributed --timeout 600\nimport os\nint(os.environ['WORLD_SIZE'])").check(
        clean_stderr=True
    )
    assert out.result == "[3, 3, 3]"
    spec = f"{magics}.last_result.spec"
    assert notebook.value(f"{spec}.accelerator_type, {spec}.mlflow") == "('CPU', False)"
    assert notebook.value(f"{magics}.settings('--timeout none --gpus 2').timeout") == "None"
    assert notebook.value(f"{magics}.settings('--timeout 60').num_accelerators") == "3"

    slow = notebook.execute("%%distributed --gpus 2\nimport time\ntime.sleep(120)")
    assert slow.ename == "DistributedTimeoutError" and "timeout of 4 s" in slow.traceback, slow.traceback
    assert "--timeout S" in slow.traceback

    notebook.execute("%config DistributedMagics.default_timeout = None").check(clean_stderr=True)
    assert notebook.value(f"{magics}.settings('').timeout") == "None"
    bad = notebook.execute("%config DistributedMagics.default_timeout = 0")
    assert "default_timeout" in bad.traceback + bad.stderr and "more than 0" in bad.traceback + bad.stderr


def test_black_with_the_project_settings_formats_distributed_cells_as_python():
    """pyproject.toml's python_cell_magics makes black format the body of a %%distributed cell, which it skips
    otherwise."""
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
    loaded.execute(f"import os as _os; _os.environ.update({REAL_NODE!r})").check()  # see the real GPUs
    try:
        out = loaded.execute(
            "%%distributed --no-mlflow\n"
            "import os, torch, torch.distributed as dist\n"
            "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
            "dist.init_process_group('nccl')\n"
            "t = torch.ones(1, device='cuda') * (dist.get_rank() + 1)\n"
            "dist.all_reduce(t)\n"
            "(dist.get_rank(), torch.cuda.current_device(), t.item())\n"
        ).check(clean_stderr=True)
        total = float(gpus * (gpus + 1) // 2)
        assert loaded.value(f"Out[{out.execution_count}] == [(r, r, {total}) for r in range({gpus})]") == "True", (
            out.result
        )
        assert (
            loaded.value("'torch' not in __import__('sys').modules or not __import__('torch').cuda.is_initialized()")
            == "True"
        )
    finally:
        loaded.execute("_os.environ['AIR_MAGIC_FORCE_CPU'] = '1'").check(clean_stderr=True)
