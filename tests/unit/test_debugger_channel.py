"""A rank's debugger and the notebook's answers through the run directory, without a kernel: a RankPdb in a thread
stands for the rank, a DebugServer with scripted answers for the person."""

from __future__ import annotations

import bdb
import os
import pdb  # noqa: T100 - the debugger under test
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

from air_magic import envvars
from air_magic.calls.debugging import DebugServer
from air_magic.errors import DebuggerQuit
from air_magic.launch.files import debug_channel
from air_magic.launch.files.rundir import RunDir
from air_magic.launch.rank import debugger as rank_debugger


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunDir:
    """A run directory whose rank 1 has its debugger installed (pdb.Pdb is put back after the test)."""
    monkeypatch.setattr(pdb, "Pdb", pdb.Pdb)
    monkeypatch.setenv(envvars.DEBUG_SERVED, "1")
    rd = RunDir(tmp_path)
    for rank in range(2):
        rd.log(rank).write_bytes(b"")
    rank_debugger.install(rd, 1)
    return rd


def _rank(body, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _serve(server: DebugServer, thread: threading.Thread) -> None:
    deadline = time.monotonic() + 30
    while thread.is_alive():
        assert time.monotonic() < deadline, "the rank's debugger never finished"
        server.serve()
        time.sleep(0.01)


def test_a_prompt_names_the_rank_and_p_n_c_work_through_the_files(run_dir: RunDir):
    """`p` shows a local, `n` steps to the next line, `c` lets the rank go on; the files are gone after clean()."""
    seen: list[str] = []

    def body() -> None:
        x = 41
        rank_debugger.RankPdb().set_trace()
        y = x + 1
        seen.append(str(y))

    answers = iter(["p x", "n", "p y", "c"])
    prompts: list[str] = []
    shown: list[str] = []
    server = DebugServer(run_dir.path, 2, ask=lambda p: prompts.append(p) or next(answers), show=shown.append)
    errors: list[BaseException] = []
    _serve(server, _rank(body, errors))
    assert not errors and seen == ["42"]
    assert prompts == ["(Pdb rank 1) "] * 4
    text = "".join(shown)
    assert "41\n" in text and "42\n" in text and "y = x + 1" in text
    server.close()
    assert not list(run_dir.path.glob("debug-*"))


def test_q_becomes_debugger_quit_naming_the_rank(run_dir: RunDir):
    """`q` raises BdbQuit in the rank's code, which the worker reports as DebuggerQuit naming the rank."""
    server = DebugServer(run_dir.path, 2, ask=lambda p: "q", show=lambda t: None)
    errors: list[BaseException] = []
    _serve(server, _rank(lambda: rank_debugger.RankPdb().set_trace(), errors))
    assert len(errors) == 1 and isinstance(errors[0], bdb.BdbQuit)
    quit_error = rank_debugger.translated(errors[0], 1)
    assert isinstance(quit_error, DebuggerQuit) and "rank 1" in str(quit_error)
    assert rank_debugger.translated(ValueError("x"), 1).args == ("x",)


def test_a_frontend_without_input_gets_one_message_and_the_rank_continues(run_dir: RunDir):
    """An ask that cannot read input (IPython's StdinNotImplementedError is a NotImplementedError): `c`, said once."""

    def no_input(prompt: str) -> str:
        raise NotImplementedError("raw_input was called, but this frontend does not support input requests.")

    def body() -> None:
        for _ in range(2):
            rank_debugger.RankPdb().set_trace()

    shown: list[str] = []
    server = DebugServer(run_dir.path, 2, ask=no_input, show=shown.append)
    errors: list[BaseException] = []
    _serve(server, _rank(body, errors))
    assert not errors
    assert sum("cannot answer input requests" in s for s in shown) == 1


def test_a_rank_whose_launcher_cannot_answer_fails_at_once(run_dir: RunDir, monkeypatch: pytest.MonkeyPatch):
    """Without the launcher's say-so (Ray), entering the debugger raises instead of waiting for nobody."""
    monkeypatch.delenv(envvars.DEBUG_SERVED)
    rank_debugger.install(run_dir, 1)
    with pytest.raises(RuntimeError, match="Ray"):
        rank_debugger.RankPdb()


def test_an_answer_to_a_rank_that_is_gone_says_so(run_dir: RunDir):
    """No rank reads the FIFO: answer() is False instead of blocking."""
    debug_channel.post(run_dir, debug_channel.Prompt(1, 1, "(Pdb rank 1) "))
    assert debug_channel.waiting(run_dir.path, 2).keys() == {1}
    assert debug_channel.answer(run_dir, 1, "c") is False
    assert debug_channel.waiting(run_dir.path, 2) == {}


def test_a_function_pickled_by_value_gets_its_real_file_back():
    """cloudpickle's '<dynamic-code>' is replaced by the file the notebook's code map names, nested code too."""

    def outer() -> int:
        def inner() -> int:
            return 1

        return inner()

    code = outer.__code__
    copy = cloudpickle.loads(cloudpickle.dumps(outer))
    copy.__code__ = copy.__code__.replace(co_filename="<dynamic-code>")
    rank_debugger.new_call(copy, {f"outer:{code.co_firstlineno}": "/notebook/cell-1.py"})
    assert copy.__code__.co_filename == "/notebook/cell-1.py"
    nested = [c for c in copy.__code__.co_consts if hasattr(c, "co_filename")]
    assert nested and all(c.co_filename == "/notebook/cell-1.py" for c in nested)
    assert copy() == 1


def test_the_note_of_ranks_at_a_prompt_names_them_and_the_magic_that_attaches():
    """A panel and %distributed_calls say which ranks wait at a breakpoint, and how to attach to the first."""
    assert debug_channel.waiting_note(set()) == ""
    assert debug_channel.waiting_note({3, 1}) == "rank 1, 3 at a breakpoint (%distributed_debug --rank 1)"


def test_a_served_rank_drops_rays_driver_breakpoint_hook_inherited_from_the_notebook(tmp_path, monkeypatch):
    """A notebook that ran ray.init() leaves PYTHONBREAKPOINT naming Ray's driver hook; a local rank whose
    prompts the notebook serves uses its own debugger instead (a user's PYTHONBREAKPOINT=0 is kept)."""
    monkeypatch.setenv(envvars.DEBUG_SERVED, "1")
    monkeypatch.setenv("PYTHONBREAKPOINT", "ray.util.rpdb._driver_set_trace")
    monkeypatch.setattr(pdb, "Pdb", pdb.Pdb)
    rank_debugger.install(RunDir(tmp_path), 0)
    assert "PYTHONBREAKPOINT" not in os.environ
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    rank_debugger.install(RunDir(tmp_path), 0)
    assert os.environ["PYTHONBREAKPOINT"] == "0"
