"""The debugger inside a rank: `breakpoint()`, `pdb.set_trace()`, `torch.distributed.breakpoint()` and a
session's post-mortem, answered from the notebook.

`install` (at the start of every call, worker.py) makes `pdb.Pdb` a `RankPdb`
in the rank's process, so every route into pdb lands here: `breakpoint()`
(through `sys.breakpointhook`, which honours `PYTHONBREAKPOINT`),
`pdb.set_trace()`, `pdb.post_mortem()` and torch's `breakpoint(rank=R)`, which
subclasses `pdb.Pdb` when called. A `RankPdb` reads its commands and writes
its output through debug_channel.py: each prompt goes to the run directory,
and the rank blocks until the notebook answers. Its prompt names the rank,
`(Pdb rank 1) `. Stepping never stops in air_magic's own frames.

Where no one answers (a launcher whose ranks run on other machines: Ray),
entering the debugger raises at once, saying so, rather than hang.

`q` ends the user's code with `bdb.BdbQuit`, which `translated` turns into
`DebuggerQuit` naming the rank. A session call's error is kept here with its
frames (`keep`) until the session's next cell (`new_call`), so that
`%distributed_debug` can open a post-mortem on it (`LastError`, `PostMortem`).

Runs in the worker; imports no IPython.
"""

from __future__ import annotations

import bdb
import inspect
import os
import pdb  # noqa: T100 - the rank's debugger is what this module is for
import sys
import threading
import time
from types import CodeType, FrameType, TracebackType
from typing import Any

from ... import envvars
from ...errors import DebuggerQuit
from ..files import debug_channel
from ..files.rundir import RunDir
from .session import Namespace, Reset, SessionOp

#: Modules whose frames stepping never stops in.
SKIP = ("air_magic", "air_magic.*")
#: air_magic's modules that call the user's code: the debugger's stack starts below their last frame.
CALLERS = frozenset({"air_magic.launch.rank.worker", "air_magic.launch.rank.session", "air_magic.cell", __name__})
#: What a command line to a pdb prompt is answered with when it ends the rank's debugging for now.
ENDS = frozenset({"c", "cont", "continue", "q", "quit", "exit", "EOF"})

_lock = threading.RLock()


class _State:
    """This rank's call, as the debugger needs it (module state: a hot rank serves one call after another)."""

    run_dir: RunDir | None = None
    rank = 0
    served = False
    #: The person's Ctrl-C reached the rank at a prompt: the quit that follows is a KeyboardInterrupt.
    interrupted = False
    #: A session call's error (and when it was raised), kept with its frames for a post-mortem.
    kept: tuple[BaseException, float] | None = None


state = _State()


def install(run_dir: RunDir, rank: int) -> None:
    """Before a call: `pdb.Pdb` is `RankPdb` here, answered through `run_dir` if the launcher serves it."""
    state.run_dir, state.rank, state.interrupted = run_dir, rank, False
    state.served = os.environ.get(envvars.DEBUG_SERVED) == "1"
    pdb.Pdb = RankPdb  # type: ignore[misc]
    if state.served and os.environ.get("PYTHONBREAKPOINT", "").startswith("ray.util."):
        # Ray's driver hook, inherited from a notebook that ran ray.init(): it fails outside a Ray worker
        del os.environ["PYTHONBREAKPOINT"]
    if sys.gettrace() is not None and isinstance(getattr(sys.gettrace(), "__self__", None), bdb.Bdb):
        sys.settrace(None)  # a debugger left tracing by the last call of a hot rank


class _Channel:
    """pdb's stdin and stdout at once: output is gathered, and reading a line sends it with the prompt."""

    def __init__(self, debugger: RankPdb) -> None:
        self.debugger = debugger
        self.pending: list[str] = []

    def write(self, text: str) -> int:
        self.pending.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        output, self.pending = "".join(self.pending), []
        prompt = self.debugger.prompt
        output = output.removesuffix(prompt)
        return ask(output, prompt, self.debugger.where()) + "\n"


def ask(output: str, prompt: str, where: str) -> str:
    """Post a prompt for the notebook and block until it answers; the answer line."""
    run_dir, rank = state.run_dir, state.rank
    assert run_dir is not None
    with _lock:  # two threads of one rank at a breakpoint: one prompt at a time
        fd = debug_channel.open_answers(run_dir, rank)
        try:
            debug_channel.post(run_dir, debug_channel.Prompt(rank, os.getpid(), prompt, output, where, time.time()))
            return debug_channel.read_line(fd)
        except KeyboardInterrupt:  # the call is being interrupted: leave the debugger, then raise it
            debug_channel.withdraw(run_dir, rank)
            state.interrupted = True
            return "q"
        finally:
            os.close(fd)


class RankPdb(pdb.Pdb):  # the standard class: install() replaces pdb.Pdb later
    """pdb whose prompt is answered in the notebook's cell; otherwise the standard debugger."""

    def __init__(
        self,
        completekey: str = "tab",
        stdin: Any = None,
        stdout: Any = None,
        skip: Any = None,
        nosigint: bool = False,
        readrc: bool = True,
    ) -> None:
        own = stdin is None and stdout is None
        if own and not state.served:
            raise RuntimeError(
                f"breakpoint() on rank {state.rank}: this launcher cannot answer a debugger from the notebook yet "
                "(ranks on other machines, through Ray); debug on one node (num_nodes=1), or set "
                "PYTHONBREAKPOINT=0 to skip breakpoints."
            )
        channel: Any = _Channel(self) if own else None
        super().__init__(
            completekey,
            stdin or channel,
            stdout or channel,
            skip=[*SKIP, *(skip or ())],
            nosigint=True,  # pdb's own SIGINT handler would take the session's interrupt away
            readrc=readrc,
        )
        if own:
            self.prompt = f"(Pdb rank {state.rank}) "

    def setup(self, f: FrameType | None, tb: TracebackType | None) -> None:
        """As pdb's, with the stack starting at the user's code (`w` and `u` do not wander into air_magic's)."""
        super().setup(f, tb)
        callers = [i for i, (frame, _) in enumerate(self.stack[: self.curindex]) if _module(frame) in CALLERS]
        if callers:
            del self.stack[: callers[-1] + 1]
            self.curindex -= callers[-1] + 1

    def where(self) -> str:
        frame = getattr(self, "curframe", None)
        return "" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def translated(exc: BaseException, rank: int) -> BaseException:
    """The exception a call's error is reported as: `q` at a prompt (BdbQuit) as DebuggerQuit naming the rank."""
    if not isinstance(exc, bdb.BdbQuit):
        return exc
    if state.interrupted:
        new: BaseException = KeyboardInterrupt()
    else:
        new = DebuggerQuit(f"rank {rank}: `q` at its debugger's prompt ended the call")
    return new.with_traceback(exc.__traceback__)


# -- post-mortem (sessions) ---------------------------------------------------------------
def new_call(target: object, code_files: dict[str, str]) -> None:
    """Before a call's target runs: a session's next cell or function (not a debugger's own call) lets go of the
    last error's frames, and a function pickled by value gets its real file name back, so that pdb shows its
    lines (cloudpickle names it '<dynamic-code>'; `code_files` maps "name:first line" to the file)."""
    if not isinstance(target, SessionOp) or isinstance(target, Reset):
        state.kept = None
    for func in {id(f): f for f in (target, inspect.unwrap(target))}.values() if callable(target) else ():
        code = getattr(func, "__code__", None)
        if inspect.isfunction(func) and isinstance(code, CodeType) and code.co_filename == "<dynamic-code>":
            func.__code__ = _named(code, code_files)


def _named(code: CodeType, code_files: dict[str, str], parent: str | None = None) -> CodeType:
    """`code` and the code inside it under their real file (nested code not in the map: its parent's)."""
    real = code_files.get(f"{code.co_name}:{code.co_firstlineno}") or parent or code.co_filename
    consts = tuple(_named(c, code_files, real) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=real, co_consts=consts)


def keep(exc: BaseException, target: object) -> bool:
    """Keep a session call's error with its frames for `%distributed_debug`; False if it is not one to keep."""
    if target is None or isinstance(target, SessionOp):
        return False
    state.kept = (exc, time.time())
    return True


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the first frame that is not air_magic's own (the user's code), if there is one."""
    first = tb
    while tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("air_magic"):
        tb = tb.tb_next
    return tb or first


class LastError(SessionOp):
    """What error this rank keeps for a post-mortem: (type, message, when raised), or None."""

    def apply(self, ns: Namespace, rank: int) -> Any:
        if state.kept is None:
            return None
        exc, at = state.kept
        return (type(exc).__name__, str(exc), at)


class PostMortem(SessionOp):
    """Open the debugger on the kept error's traceback, as it was: its frames and their locals."""

    def apply(self, ns: Namespace, rank: int) -> Any:
        if state.kept is None:
            raise LookupError(f"rank {rank} keeps no error: the session ran a cell since, or the last one raised none")
        exc = state.kept[0]
        debugger = pdb.Pdb()
        debugger.message(f"post-mortem on rank {rank}: {type(exc).__name__}: {exc}")
        debugger.reset()
        debugger.interaction(None, _user_traceback(exc.__traceback__))
        if state.interrupted:
            raise KeyboardInterrupt
        return None
