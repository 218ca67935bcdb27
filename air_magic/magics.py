"""IPython glue for air_magic: the %%distributed cell magic and `%load_ext air_magic`.

Only glue lives here: option parsing (IPython's `magic_arguments`), the
defaults users set in `ipython_kernel_config.py` (traitlets config on
`DistributedMagics`), and registration. The cell becomes a `CellProgram`
(cell.py) and takes the same path as the decorator: `Settings(...).spec(...)`
then `runner.run(spec)`.

Over 300 lines because it is the one module of IPython glue: every magic's options and help are declared here,
the logic lives elsewhere.
"""

from __future__ import annotations

import argparse
import keyword
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Integer, TraitError, Unicode, validate

from . import launch, notebook_code, sessions
from .cell import CellProgram, ends_with_semicolon
from .decorator import DEFAULT_TIMEOUT, Settings, check_keep_alive, check_max_restarts, check_timeout
from .errors import AirMagicError, ConfigurationError
from .job import JobResult

_DEFAULT: Any = object()  # an option the cell did not give: the configured default applies


def _given(value: Any, default: Any) -> Any:
    return default if value is _DEFAULT else value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of workers such as 2, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 worker, got {value}")
    return value


def _nodes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of machines such as 2, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 node, got {value}")
    return value


def _seconds(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds such as 3600, or none for no limit, got {text!r}") from None
    try:
        return check_timeout(value)
    except ConfigurationError:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 seconds, got {text!r}; use --timeout none for no limit"
        ) from None


def _keep_alive(text: str) -> float | None:
    try:
        return check_keep_alive(float(text))
    except (ValueError, ConfigurationError):
        raise argparse.ArgumentTypeError(f"expected seconds more than 0 such as 600, got {text!r}") from None


def _restarts(text: str) -> int:
    try:
        return check_max_restarts(int(text))
    except (ValueError, ConfigurationError):
        raise argparse.ArgumentTypeError(
            f"expected a whole number of restarts, 0 or more, such as 2, got {text!r}"
        ) from None


def _ranks(text: str) -> tuple[int, ...]:
    """The text of --ranks as rank numbers; whether they fit a session is Settings' check (sessions.check_ranks)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rank numbers such as 0 or 0,2, got {text!r}") from None


def _session_name(text: str) -> str:
    try:
        return sessions.check_name(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _session_option(help: str) -> Any:
    """The --session option of the line magics that act on one session."""
    return argument("--session", default=sessions.DEFAULT_SESSION, type=_session_name, metavar="NAME", help=help)


def _identifier(text: str) -> str:
    if not text.isidentifier() or keyword.iskeyword(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid Python variable name")
    return text


def _cell_file(shell: Any, text: str) -> tuple[str, int | None]:
    """IPython's file name for the cell being run, and its execution count.

    The cell's own code (`get_ipython().run_cell_magic(...)`) is compiled under
    that name, so it is the nearest frame whose file IPython's compiler knows.
    """
    known: dict[str, int] = getattr(shell.compile, "_filename_map", {})
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name in known:
            return name, known[name]
        frame = frame.f_back
    # called some other way (run_cell_magic from code): give the text a name of its own
    return shell.compile.cache(text, getattr(shell, "execution_count", 0)), None


def _uses_ipython_syntax(shell: Any, cell: str) -> bool:
    try:
        return bool(shell.transform_cell(cell).strip() != cell.strip())
    except Exception:  # noqa: BLE001 - only used to word an error better
        return False


@magics_class
class DistributedMagics(Magics):
    """The %%distributed cell magic; its defaults are config, e.g. `c.DistributedMagics.default_timeout = 600`."""

    default_timeout = Float(
        DEFAULT_TIMEOUT,
        allow_none=True,
        help="Seconds before a %%distributed cell's workers are stopped, when the cell gives no --timeout. "
        "None: no limit.",
    ).tag(config=True)
    default_accelerator_type = Unicode(
        None,
        allow_none=True,
        help="Accelerator type when the cell gives no --accelerator-type: 'CPU', 'GPU', 'GPU_<n>x<MODEL>'. "
        "None: detected.",
    ).tag(config=True)
    default_num_accelerators = Integer(
        None,
        allow_none=True,
        help="Workers to start when the cell gives no --gpus. None: every GPU (2 CPU workers without GPUs).",
    ).tag(config=True)
    mlflow = Bool(
        True, help="Record each %%distributed cell as an MLflow run. False: as if every cell had --no-mlflow."
    ).tag(config=True)
    default_keep_alive = Float(
        None,
        allow_none=True,
        help="Hot ranks: seconds a cell's ranks stay alive for the next cell of the same world, when the cell "
        "gives no --keep-alive. None: ranks end with each cell.",
    ).tag(config=True)

    default_max_restarts = Integer(
        0,
        help="Times every rank of a cell starts again after a rank fails, when the cell gives no --max-restarts. "
        "0: the cell fails with the first failure.",
    ).tag(config=True)

    #: The JobResult of the last cell that finished (run directory, exit codes, timing).
    last_result: JobResult | None = None

    @validate("default_timeout")
    def _valid_timeout(self, proposal: dict[str, Any]) -> float | None:
        try:
            return check_timeout(proposal["value"])
        except ConfigurationError as exc:
            raise TraitError(f"c.DistributedMagics.default_timeout: {exc}") from None

    @validate("default_keep_alive")
    def _valid_keep_alive(self, proposal: dict[str, Any]) -> float | None:
        try:
            return check_keep_alive(proposal["value"])
        except ConfigurationError as exc:
            raise TraitError(f"c.DistributedMagics.default_keep_alive: {exc}") from None

    @validate("default_max_restarts")
    def _valid_max_restarts(self, proposal: dict[str, Any]) -> int:
        try:
            return check_max_restarts(proposal["value"])
        except ConfigurationError as exc:
            raise TraitError(f"c.DistributedMagics.default_max_restarts: {exc}") from None

    @validate("default_num_accelerators")
    def _valid_count(self, proposal: dict[str, Any]) -> int | None:
        value = proposal["value"]
        if value is not None and value < 1:
            raise TraitError(f"c.DistributedMagics.default_num_accelerators must be at least 1 or None, got {value}.")
        return value

    def settings(self, line: str) -> Settings:
        """The Settings of a `%%distributed` line: its options over the configured defaults."""
        args = parse_argstring(self.distributed, line)
        return self._settings(args)

    def _settings(self, args: argparse.Namespace) -> Settings:
        return Settings(
            num_accelerators=_given(args.num_accelerators, self.default_num_accelerators),
            accelerator_type=_given(args.accelerator_type, self.default_accelerator_type),
            timeout=_given(args.timeout, self.default_timeout),
            mlflow=self.mlflow and not args.no_mlflow,
            keep_alive=_given(args.keep_alive, self.default_keep_alive),
            num_nodes=args.nodes,
            max_restarts=_given(args.max_restarts, self.default_max_restarts),
            session=args.session,
            ranks=args.ranks,
        )

    @magic_arguments()
    @argument(
        "--gpus",
        "--num-accelerators",
        dest="num_accelerators",
        type=_count,
        default=_DEFAULT,
        metavar="N",
        help="Workers to start, one per accelerator. Default: every GPU of the node (2 CPU workers without GPUs), "
        "or c.DistributedMagics.default_num_accelerators.",
    )
    @argument(
        "--accelerator-type",
        dest="accelerator_type",
        default=_DEFAULT,
        metavar="T",
        help="'GPU_<n>x<MODEL>' such as GPU_8xH100, or CPU (gloo workers). Default: detected.",
    )
    @argument(
        "--timeout",
        type=_seconds,
        default=_DEFAULT,
        metavar="S",
        help="Seconds before every worker is stopped; 'none' for no limit. Default: 10800 (3 h), "
        "or c.DistributedMagics.default_timeout.",
    )
    @argument(
        "--nodes",
        type=_nodes,
        default=1,
        metavar="N",
        help="Machines of the Ray cluster joined with air_magic.ray_init() to run on, --gpus ranks on each. "
        "Default: 1, this node, without Ray.",
    )
    @argument("--no-mlflow", action="store_true", help="Do not record this cell as an MLflow run.")
    @argument(
        "--keep-alive",
        dest="keep_alive",
        type=_keep_alive,
        default=_DEFAULT,
        metavar="S",
        help="Hot ranks: keep the ranks alive S seconds after the cell, so the next cell of the same world starts "
        "in them at once (CUDA context, process group and imports kept). %%distributed_release ends them.",
    )
    @argument(
        "--max-restarts",
        dest="max_restarts",
        type=_restarts,
        default=_DEFAULT,
        metavar="N",
        help="When a rank fails, stop every rank and start the cell again on all of them, up to N times "
        "(TORCHELASTIC_RESTART_COUNT tells the ranks which attempt it is). Default: 0, "
        "or c.DistributedMagics.default_max_restarts.",
    )
    @argument(
        "--session",
        nargs="?",
        const=sessions.DEFAULT_SESSION,
        default=None,
        type=_session_name,
        metavar="NAME",
        help="Run in session NAME (default: 'default'): the first such cell starts hot ranks, later ones run in the "
        "same processes and namespace, so what a cell assigns or imports is there for the next. Names the session "
        "assigned win over notebook globals. An error in your code keeps the session; Ctrl-C and Cancel raise "
        "KeyboardInterrupt on the ranks and keep it too when they come back. Idle for --keep-alive seconds "
        "(default 3600) it ends. %%distributed_session lists sessions.",
    )
    @argument(
        "--ranks",
        type=_ranks,
        default=None,
        metavar="R",
        help="With --session: run the cell on these ranks of the session only, such as 0 or 0,2; the result "
        "holds their values in rank order.",
    )
    @argument(
        "--out",
        type=_identifier,
        default=None,
        metavar="NAME",
        help="Also store the per-rank list of results in the notebook under NAME (with --background: the handle).",
    )
    @argument(
        "--background",
        action="store_true",
        help="Start the ranks and return at once with a DistributedCall handle (its .result() waits for the "
        "values); the kernel is free while they run. %%distributed_calls lists such calls, %%distributed_show "
        "draws one's panel.",
    )
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run this cell on one worker process per accelerator (or N CPU workers with gloo).

        The cell runs on every rank with the notebook's globals it uses
        (functions, classes, constants; modules by reference) and RANK,
        LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set. Each rank's
        output is streamed live. The result of the cell is the value of its
        last expression on every rank, as a list indexed by rank. Names the
        cell assigns stay on the workers; use --out or the result to bring
        values back. With --nodes N the cell runs on N machines of the Ray
        cluster joined with air_magic.ray_init(), --gpus ranks on each.

            %%distributed --gpus 2
            import torch.distributed as dist
            dist.init_process_group("gloo")
            dist.get_rank()
        """
        __tracebackhide__ = True
        shell = self.shell
        assert shell is not None, "DistributedMagics is registered with a shell"
        args = parse_argstring(self.distributed, line)
        settings = self._settings(args)
        first_line = f"%%distributed {line}".rstrip()
        filename, number = _cell_file(shell, f"{first_line}\n{cell}")
        try:
            program = CellProgram.build(cell, filename, shell.user_ns, shell.user_ns_hidden, first_line=first_line)
        except SyntaxError as exc:
            if _uses_ipython_syntax(shell, cell):
                exc.add_note(
                    "%%distributed cells are plain Python: IPython syntax (%magics, !commands) runs only "
                    "in the notebook, not on the workers."
                )
            raise
        for held in sessions.held_names(settings.session):  # the session's own objects win: never sent again
            program.used_globals.pop(held, None)
        name = "cell" if number is None else f"cell In[{number}]"
        if args.background:
            from .background import spawn

            handle = spawn(settings.spec(program, (), {}, name, origin="cell"))
            if args.out:
                shell.user_ns[args.out] = handle
            return None if args.out or ends_with_semicolon(cell) else handle
        result = sessions.run(settings.spec(program, (), {}, name, origin="cell")).raise_for_status()
        self.last_result = result
        values = result.values
        if args.out:
            shell.user_ns[args.out] = values
        return None if ends_with_semicolon(cell) else values

    @line_magic
    def distributed_release(self, line: str = "") -> None:
        """End every hot rank of this kernel now (see --keep-alive), sessions included; their GPU memory is freed."""
        launch.release_hot()
        for said in sessions.released():
            print(said)

    @line_magic
    def distributed_calls(self, line: str = "") -> None:
        """List this kernel's background calls: id, function or cell, status, ranks, GPUs, started, elapsed, MLflow."""
        from . import background

        print(background.table())

    @magic_arguments()
    @argument("id", nargs="?", type=int, default=None, help="The call's id (%%distributed_calls). Default: the latest.")
    @line_magic
    def distributed_show(self, line: str = "") -> None:
        """Draw a background call's panel in this cell: live, with every line its ranks wrote so far, while it runs;
        its record once it ended."""
        from . import background

        args = parse_argstring(self.distributed_show, line)
        try:
            call = background.find(args.id)
        except ConfigurationError as exc:
            raise UsageError(str(exc)) from None
        call.show()

    @magic_arguments()
    @argument(
        "id",
        nargs="?",
        default=None,
        metavar="ID",
        help="The call to stop: a background call's id (%%distributed_calls), or its run directory's name. "
        "Default: the call running now, else the latest background call.",
    )
    @line_magic
    def distributed_stop(self, line: str = "") -> None:
        """Stop a call after its current step: `air_magic.should_stop()` turns True on every rank.

        A loop that checks it once per step ends at the same step on every rank and the call returns normally
        (its MLflow run FINISHED, a session keeps everything). Code that never checks it runs on; Cancel stops at
        once. The panel's Stop button and a background call's `.stop()` do the same.

            %distributed_stop
            %distributed_stop 3
        """
        from . import stopping

        args = parse_argstring(self.distributed_stop, line)
        run_dir: Path | None = None
        try:
            run_dir = stopping.find_call(args.id)
        except LookupError as exc:
            if args.id is None or args.id.isdigit():
                from . import background

                try:
                    call = background.find(None if args.id is None else int(args.id))
                    if call.done():
                        raise UsageError(f"call {call.id} has ended ({call.status}): there is nothing to stop.")
                    run_dir = call.run_dir
                except (ConfigurationError, AirMagicError):
                    pass
            if run_dir is None:
                raise UsageError(str(exc)) from None
        assert run_dir is not None
        if stopping.request_stop(run_dir):
            print(f"asked {run_dir.name} to stop after this step: should_stop() is True on every rank from now on.")
        else:
            print(f"{run_dir.name} was already asked to stop.")

    @magic_arguments()
    @_session_option("The session to send the values to. Default: 'default'.")
    @argument("--ranks", type=_ranks, default=None, metavar="R", help="Only these ranks, such as 0 or 0,2.")
    @argument("names", nargs="+", type=_identifier, metavar="VARIABLE", help="Notebook variables to send.")
    @line_magic
    def distributed_push(self, line: str = "") -> None:
        """Send notebook variables into a session's ranks, under the same names (they then win over the notebook's).

        %distributed_push lr config
        %distributed_push --session gpt2 --ranks 0 prompt
        """
        args = parse_argstring(self.distributed_push, line)
        shell = self.shell
        assert shell is not None
        missing = [name for name in args.names if name not in shell.user_ns]
        if missing:
            raise UsageError(f"no notebook variable named {', '.join(missing)}; define it first.")
        sessions.push(args.session, {name: shell.user_ns[name] for name in args.names}, args.ranks)

    @magic_arguments()
    @_session_option("The session to read from. Default: 'default'.")
    @argument("--rank", type=int, default=None, metavar="R", help="One rank's value instead of a list by rank.")
    @argument("name", type=_identifier, metavar="VARIABLE", help="The name on the ranks.")
    @line_magic
    def distributed_pull(self, line: str = "") -> Any:
        """Bring a value back from a session's ranks: a list by rank, or one rank's value with --rank R.

        losses = %distributed_pull losses
        model_state = %distributed_pull --rank 0 state
        """
        args = parse_argstring(self.distributed_pull, line)
        return sessions.pull(args.session, args.name, args.rank)

    @magic_arguments()
    @argument(
        "--end",
        nargs="?",
        const=sessions.DEFAULT_SESSION,
        default=None,
        type=_session_name,
        metavar="NAME",
        help="End session NAME's ranks (default: 'default'); what they hold is lost.",
    )
    @argument(
        "--reset",
        nargs="?",
        const=sessions.DEFAULT_SESSION,
        default=None,
        type=_session_name,
        metavar="NAME",
        help="Empty session NAME's namespaces; the processes and process group stay.",
    )
    @line_magic
    def distributed_session(self, line: str = "") -> None:
        """List the live sessions (ranks, pids, node, device, memory, idle time left, names) and Ray's other kept
        actors (hot ranks, spares: what they hold, how long), or end or reset a session."""
        args = parse_argstring(self.distributed_session, line)
        if args.end is not None:
            print(sessions.end(args.end))
        elif args.reset is not None:
            sessions.reset(args.reset)
            print(f"session {args.reset!r}: every rank's namespace is empty; its processes stay.")
        else:
            print(sessions.table())

    @magic_arguments()
    @argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="The rank to debug. Default: the first that raised (post-mortem), or the first waiting at a breakpoint.",
    )
    @argument(
        "--session",
        default=None,
        type=_session_name,
        metavar="NAME",
        help="Post-mortem on this session's last error. Default: 'default'.",
    )
    @argument(
        "call",
        nargs="?",
        default=None,
        metavar="ID",
        help="Attach to a rank waiting at a breakpoint in this call: a background call's id (%%distributed_calls), "
        "its run directory, or part of the directory's name.",
    )
    @line_magic
    def distributed_debug(self, line: str = "") -> None:
        """Open pdb on a rank: a post-mortem of a session's last error, or a rank waiting at breakpoint().

        After a session cell raised, `%distributed_debug` opens pdb on the traceback of the rank that raised
        first (`--rank R` another), its frames and locals as they were; they are kept until the session's next
        cell. With ID, or while a call not running in this cell (a background call) has a rank waiting at
        breakpoint(), it attaches to that rank's prompt.

            %distributed_debug
            %distributed_debug --rank 1 --session gpt2
        """
        from . import debugging

        args = parse_argstring(self.distributed_debug, line)
        try:
            if args.call is not None and args.call.isdigit():  # a background call's id (%distributed_calls)
                from . import background

                debugging.attach(background.find(int(args.call)).run_dir, args.rank)
                return
            if args.call is not None:
                debugging.attach(debugging.find_waiting(args.call), args.rank)
                return
            if args.session is None:
                try:
                    waiting = debugging.find_waiting()
                except ConfigurationError:
                    waiting = None
                if waiting is not None:
                    debugging.attach(waiting, args.rank)
                    return
            sessions.post_mortem(args.session or sessions.DEFAULT_SESSION, args.rank)
        except ConfigurationError as exc:
            raise UsageError(str(exc)) from None


def load_ipython_extension(ipython: Any) -> None:
    """Register %%distributed; loading again is harmless."""
    if "DistributedMagics" not in ipython.magics_manager.registry:
        ipython.register_magics(DistributedMagics)
    if notebook_code.remember not in ipython.events.callbacks["post_run_cell"]:
        ipython.events.register("post_run_cell", notebook_code.remember)  # the notebook's modules as imported


def unload_ipython_extension(ipython: Any) -> None:
    """Remove %%distributed and stop every launcher this kernel used (and any worker each still has)."""
    manager = ipython.magics_manager
    magics = manager.registry.pop("DistributedMagics", None)
    if magics is not None:
        for table in manager.magics.values():
            for name, func in list(table.items()):
                if getattr(func, "__self__", None) is magics:
                    del table[name]
        configurables = getattr(ipython, "configurables", [])
        if magics in configurables:
            configurables.remove(magics)
    launch.shutdown()
