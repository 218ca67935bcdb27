"""Test helpers: a real Jupyter kernel to run cells in (live, or a whole notebook headless), and a finder for leftover
processes."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parent.parent
#: Inherited by every kernel, supervisor and worker a test starts, so leak checks see only this run's processes;
#: under pytest-xdist each worker has its own, so one worker's calls are never another's leftovers.
SESSION = os.environ["AIR_MAGIC_TEST_SESSION"] = (
    os.environ.get("AIR_MAGIC_TEST_SESSION") or uuid.uuid4().hex
) + os.environ.get("PYTEST_XDIST_WORKER", "")


class ErrorOutput:
    """The name and plain-text traceback of a cell's error output (`error` is the output's content)."""

    error: dict | None

    @property
    def ename(self) -> str | None:
        return None if self.error is None else self.error["ename"]

    @property
    def traceback(self) -> str:
        text = "" if self.error is None else "\n".join(self.error["traceback"])
        return re.sub(r"\x1b\[[0-9;]*m", "", text)


@dataclass
class CellResult(ErrorOutput):
    """What one executed cell produced."""

    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: dict | None = None
    displays: list[dict] = field(default_factory=list)
    #: The execute_reply's content (status, payload such as a `%%distributed?` help page).
    reply: dict = field(default_factory=dict)
    execution_count: int | None = None
    #: The prompts of the input requests the kernel sent (`Kernel.execute(answers=...)`), in order.
    prompts: list[str] = field(default_factory=list)

    def add(self, msg: dict) -> None:
        """Take in one IOPub message of the cell."""
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                self.stdout += content["text"]
            else:
                self.stderr += content["text"]
        elif kind == "execute_result":
            self.result = content["data"].get("text/plain")
        elif kind == "error":
            self.error = content
        elif kind in ("display_data", "update_display_data"):
            self.displays.append(content)
        elif kind == "execute_input":
            self.execution_count = content.get("execution_count")

    def check(self, clean_stderr: bool = False) -> CellResult:
        """Assert the cell raised nothing (and, with `clean_stderr`, wrote no error to stderr)."""
        assert self.error is None and not (clean_stderr and "Error" in self.stderr), (
            f"cell raised {self.ename}:\n{self.traceback}\nstderr:\n{self.stderr}\nstdout:\n{self.stdout}"
        )
        return self


#: Megabytes one rank prints in the panel's flood tests (test_panel.py, test_browser.py): the tail shown stays bounded
#: whatever the size; that a 200 MB flood's every byte reaches the log and the listeners is test_faults_output.py's.
FLOOD_MB = 50
#: Extra environment for a kernel that must see the node's real GPUs (the suite itself runs the CPU path).
REAL_NODE = {"AIR_MAGIC_FORCE_CPU": ""}


def wait_until(predicate: Any, timeout: float, message: str, step: float = 0.1) -> None:
    """Return once `predicate()` is true; fail with `message` (and the last thing it raised, if any) after `timeout`
    seconds. The one wait loop of the suite: a test waits for a state, never a fixed time."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} (waited {timeout:g} s)")
        time.sleep(step)


def gpu_count() -> int:
    """The GPUs this machine really has, as NVML sees them (the suite's CPU setting aside)."""
    from air_magic import accelerators

    return accelerators._visible(accelerators._nvml_devices()[0])


def gpu_module_marks() -> list:
    """`pytestmark` of a module of GPU tests: slow, marked `gpu`, and skipped where NVML sees no GPU."""
    return [
        pytest.mark.slow,
        pytest.mark.gpu,
        pytest.mark.skipif(gpu_count() < 1, reason="needs an NVIDIA GPU"),
    ]


def mlflow_run(cli: Any, run_id: str) -> dict[str, Any]:
    """An MLflow run as the `cli` fixture's processes see it (its environment, its directory), read in a process of
    its own: `name`, `experiment`, `tags`, `metrics` (last values) and `highest` (each metric's highest value)."""
    done = subprocess.run(
        [sys.executable, "-c", _MLFLOW_RUN, run_id],
        cwd=cli.root,
        env=cli.env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


_MLFLOW_RUN = """
import json, mlflow, sys
client = mlflow.MlflowClient()
run = client.get_run(sys.argv[1])
metrics = run.data.metrics
print(json.dumps({
    "name": run.info.run_name,
    "experiment": client.get_experiment(run.info.experiment_id).name,
    "tags": run.data.tags,
    "metrics": metrics,
    "highest": {k: max(m.value for m in client.get_metric_history(sys.argv[1], k)) for k in metrics},
}))
"""


def kernel_env(workdir: Path, **extra: str) -> dict[str, str]:
    """What a test kernel runs with: private run directories and MLflow store under `workdir`, plain-text display."""
    return {
        "AIR_MAGIC_RUNS_DIR": str(workdir / "runs"),
        "AIR_MAGIC_DISPLAY": "text",
        "MLFLOW_TRACKING_URI": mlflow_store(workdir),
        **extra,
    }


_empty_store: list[Path] = []


def mlflow_store(workdir: Path) -> str:
    """The URI of a private sqlite MLflow store in `workdir` (`mlflow.db`), made as a copy of an empty store that this
    pytest process made once: a new store runs MLflow's schema migrations in the first process that opens it (about
    1 CPU-second more than opening a copy, in each of the suite's many stores). The copy's Default experiment keeps
    its artifacts under `workdir/mlruns`, where a store made there would."""
    db = workdir / "mlflow.db"
    if not db.exists() and workdir.is_dir():
        if not _empty_store:
            template = Path(tempfile.mkdtemp(prefix="air_magic-test-store-")) / "mlflow.db"
            code = "import mlflow, sys; mlflow.MlflowClient(sys.argv[1]).search_experiments()"
            subprocess.run([sys.executable, "-c", code, f"sqlite:///{template}"], check=True, capture_output=True)
            _empty_store.append(template)
        shutil.copyfile(_empty_store[0], db)
        with contextlib.closing(sqlite3.connect(db)) as store, store:
            store.execute(
                "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (f"{workdir}/mlruns/0",)
            )
    return f"sqlite:///{db}"


def in_order(text: str, *parts: str) -> bool:
    """Each of `parts` is in `text`, each after the one before it."""
    at = 0
    for part in parts:
        found = text.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


def run_id_of(stdout: str) -> str:
    """The MLflow run id in a call's plain-text output (`MLflow run: <link>`, the link may end in a query)."""
    for line in stdout.splitlines():
        if "MLflow run: " in line:
            return line.split("MLflow run: ", 1)[1].split()[0].split("?", 1)[0].rsplit("/", 1)[-1]
    raise AssertionError(f"no MLflow link printed:\n{stdout}")


def reported(stdout: str) -> Any:
    """The JSON of the last `REPORT <json>` line a cell printed (how kernel tests hand back what they saw)."""
    return json.loads([line for line in stdout.splitlines() if line.startswith("REPORT ")][-1][len("REPORT ") :])


def process_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a kernel or Jupyter server a test starts: ours, plus `extra`, with this checkout first on
    PYTHONPATH."""
    env = dict(os.environ)
    env.update(extra or {})
    paths = [str(ROOT), (extra or {}).get("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


def air_magic_cli(
    cwd: Path, env: dict[str, str], *args: str, timeout: float = 600, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`air-magic ARGS` as a user runs it: a process in `cwd` with `env`, its output captured, its exit code kept;
    `input` is what its standard input reads (else nothing: it is closed)."""
    return subprocess.run(
        [sys.executable, "-m", "air_magic.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )


def _runs(proc: psutil.Process) -> bool:
    """The process still runs: it exists (not a new one under its id) and has not ended (a zombie has)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Kernel:
    """A real ipykernel in its own process, driven with jupyter_client."""

    def __init__(self, cwd: Path, env: dict[str, str] | None = None) -> None:
        # jupyter_client picks the kernel's five TCP ports by binding and closing them; another process may take one
        # before the kernel binds it ("Address already in use", and the kernel dies before it replies). That is the
        # test machine's race, not air_magic's: a kernel that died so is started again, on new ports.
        for tries_left in (2, 1, 0):
            self.km = KernelManager(kernel_name="python3")
            self.km.start_kernel(cwd=str(cwd), env=process_env(env), extra_arguments=["--HistoryManager.enabled=False"])
            self.kc = self.km.client()
            # No heartbeat channel: this client asks its KernelManager whether the kernel lives (the process), and the
            # heartbeat's thread at times never joined in stop_channels (a teardown stuck for the test's whole limit).
            self.kc.start_channels(hb=False)
            try:
                self.kc.wait_for_ready(timeout=60)
                return
            except RuntimeError as exc:
                self.kc.stop_channels()
                self.km.shutdown_kernel(now=True)
                self.km.cleanup_resources()
                if not tries_left or "died before replying" not in str(exc):
                    raise

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid  # type: ignore[union-attr]

    def execute(self, code: str, timeout: float = 120, on_output=None, answers: list[str] | None = None) -> CellResult:
        """Run a cell; with `answers`, input requests are allowed and answered in turn as a frontend does (then `c`)."""
        out = CellResult()
        pending = list(answers or ())

        def hook(msg: dict) -> None:
            out.add(msg)
            if on_output is not None and msg["msg_type"] == "stream":
                on_output(msg["content"]["text"])

        def answer(msg: dict) -> None:
            out.prompts.append(msg["content"]["prompt"])
            self.kc.input(pending.pop(0) if pending else "c")

        reply = self.kc.execute_interactive(
            code, timeout=timeout, output_hook=hook, allow_stdin=answers is not None, stdin_hook=answer
        )
        out.reply = reply["content"]
        out.execution_count = out.reply.get("execution_count", out.execution_count)
        return out

    def value(self, expression: str) -> str:
        """The repr of an expression evaluated in the kernel."""
        return self.execute(f"print(repr(({expression})))").check().stdout.strip()

    def send(self, code: str) -> str:
        """Start a cell without waiting for it; returns the message id."""
        return self.kc.execute(code, allow_stdin=False)

    def collect(self, msg_id: str, timeout: float = 120, interrupt_when=None) -> CellResult:
        """Gather the output of a cell started with send() until it is idle.

        `interrupt_when(output so far)`: interrupt the kernel once it returns True, as the stop button does.
        """
        out = CellResult()
        deadline = time.monotonic() + timeout
        while True:
            if interrupt_when is not None and interrupt_when(out):
                self.interrupt()
                interrupt_when = None
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if time.monotonic() < deadline:
                    continue
                raise TimeoutError(f"cell did not finish in {timeout} s; output so far:\n{out.stdout}")
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return out
            out.add(msg)

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def kill(self) -> None:
        """SIGKILL the kernel, as a crash or `kill -9` would, then reap it and close this side's channels and sockets
        (a Popen never waited for and a zmq context left open are warnings at the next test)."""
        os.kill(self.pid, signal.SIGKILL)
        self.km.provisioner.process.wait()  # type: ignore[union-attr]
        self.kc.stop_channels()
        self.km.cleanup_resources()

    def shutdown(self, check: bool = True) -> None:
        """Shut the kernel down; with `check`, assert that everything it started (supervisor, workers) went too."""
        pid = self.pid
        children = psutil.Process(pid).children(recursive=True) if psutil.pid_exists(pid) else []
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)
        # A process that has ended is gone, reaped or not: one whose parent ended first waits for the machine's init
        # to reap it, which can take longer than this wait on a busy machine (a zombie is not "left").
        deadline = time.monotonic() + 15
        while (left := [p for p in children if _runs(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in left:
            proc.kill()
        assert not (check and left), f"kernel shutdown left {left}"


def execute_headless(
    cells: list[str],
    cwd: Path,
    extra_env: dict[str, str] | None = None,
    *,
    allow_errors: bool = False,
    unset: tuple[str, ...] = (),
) -> Any:
    """Run `cells` as a notebook, top to bottom, in a fresh kernel started in `cwd` (nbclient, as `jupyter nbconvert
    --execute` would); `unset` names variables the kernel must not inherit. Returns the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    env = process_env(extra_env)
    for name in unset:
        env.pop(name, None)
    NotebookClient(
        nb,
        kernel_name="python3",
        timeout=240,
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(cwd)}},
        extra_arguments=["--HistoryManager.enabled=False"],
    ).execute(env=env)
    return nb


def ours(proc: psutil.Process, kind: str | None = None) -> bool:
    """A process this test run started through air_magic: a supervisor, a worker, or anything a worker started.

    kind="job" keeps only workers and what they started (they carry AIR_MAGIC_JOB).
    """
    try:
        env = proc.environ()
        if env.get("AIR_MAGIC_TEST_SESSION") != SESSION:
            return False
        if "AIR_MAGIC_JOB" not in env and not any("air_magic" in part for part in proc.cmdline()):
            return False  # a kernel or another helper of the tests, not something air_magic started
        if kind == "job":
            return not is_supervisor(proc)
        return True
    except psutil.Error:
        return False


def is_supervisor(proc: psutil.Process) -> bool:
    """A per-kernel helper (the supervisor, the MLflow UI), not a worker forked from the supervisor."""
    try:
        if "air_magic.tracking.ui" in " ".join(proc.cmdline()) or "mlflow" in proc.name():
            return True
        mine = "air_magic.launch.local.supervisor" in " ".join(proc.cmdline())
        parent = proc.parent()
        return mine and (parent is None or "air_magic.launch.local.supervisor" not in " ".join(parent.cmdline()))
    except psutil.Error:
        return False


def leftover_processes(
    before: set[int],
    wait: float = 10.0,
    kind: str | None = None,
    allowed: Callable[[psutil.Process], bool] | None = None,
) -> list[psutil.Process]:
    """air_magic processes that were not there before, after waiting up to `wait` s for them to go.

    Processes for which `allowed` says True (a live kernel's supervisor) are not waited for.
    """
    deadline = time.monotonic() + wait
    while True:
        left = []
        for proc in psutil.process_iter():
            if proc.pid in before or proc.pid == os.getpid():
                continue
            try:
                if proc.status() != psutil.STATUS_ZOMBIE and ours(proc, kind) and not (allowed and allowed(proc)):
                    left.append(proc)
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def python() -> str:
    return sys.executable


def distributed_cell(kernel: Kernel, line: str, body: str, timeout: float = 120) -> CellResult:
    """Run `body` as a `%%distributed {line}` cell in `kernel`."""
    return kernel.execute(f"%%distributed {line}\n{body}", timeout=timeout)


def cell_values(result: CellResult) -> Any:
    """The per-rank list a cell returned (its repr evaluated here); fails with the cell's traceback if it raised."""
    assert result.error is None, result.traceback
    return eval(result.result or "None")
