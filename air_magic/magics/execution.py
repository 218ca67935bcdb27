"""The %%distributed cell magic and its defaults, which users set in `ipython_kernel_config.py` (traitlets config on
`DistributedMagics`, e.g. `c.DistributedMagics.default_timeout = 600`).

Only glue: the cell becomes a `CellProgram` (cell.py) and takes the same path as the decorator:
`Settings(...).spec(...)`, then `background.run(spec)` (a foreground call), or `background.spawn(spec)` with
--background.
"""

from __future__ import annotations

import argparse
import sys
from types import FrameType
from typing import Any

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Integer, TraitError, Unicode, validate

from ..cell import CellProgram, ends_with_semicolon
from ..decorator import DEFAULT_TIMEOUT, Settings, check_keep_alive, check_max_restarts, check_timeout
from ..errors import ConfigurationError
from ..job import ON_HANG, JobResult
from ..owner import BACKGROUND, owner
from . import options
from .options import DEFAULT, given


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
            num_accelerators=given(args.num_accelerators, self.default_num_accelerators),
            accelerator_type=given(args.accelerator_type, self.default_accelerator_type),
            timeout=given(args.timeout, self.default_timeout),
            mlflow=self.mlflow and not args.no_mlflow,
            keep_alive=given(args.keep_alive, self.default_keep_alive),
            num_nodes=args.nodes,
            max_restarts=given(args.max_restarts, self.default_max_restarts),
            session=args.session,
            ranks=args.ranks,
            watch=not args.no_watch,
            on_hang=args.on_hang,
            profile=args.profile,
            memory_history=args.memory_history,
        )

    @magic_arguments()
    @argument(
        "--gpus",
        "--num-accelerators",
        dest="num_accelerators",
        type=options.count,
        default=DEFAULT,
        metavar="N",
        help="Workers to start, one per accelerator. Default: every GPU of the node (2 CPU workers without GPUs), "
        "or c.DistributedMagics.default_num_accelerators.",
    )
    @argument(
        "--accelerator-type",
        dest="accelerator_type",
        default=DEFAULT,
        metavar="T",
        help="'GPU_<n>x<MODEL>' such as GPU_8xH100, or CPU (gloo workers). Default: detected.",
    )
    @argument(
        "--timeout",
        type=options.seconds,
        default=DEFAULT,
        metavar="S",
        help="Seconds before every worker is stopped; 'none' for no limit. Default: 10800 (3 h), "
        "or c.DistributedMagics.default_timeout.",
    )
    @argument(
        "--nodes",
        type=options.nodes,
        default=1,
        metavar="N",
        help="Machines of the Ray cluster joined with air_magic.ray_init() to run on, --gpus ranks on each. "
        "Default: 1, this node, without Ray.",
    )
    @argument("--no-mlflow", action="store_true", help="Do not record this cell as an MLflow run.")
    @argument(
        "--keep-alive",
        dest="keep_alive",
        type=options.keep_alive,
        default=DEFAULT,
        metavar="S",
        help="Hot ranks: keep the ranks alive S seconds after the cell, so the next cell of the same world starts "
        "in them at once (CUDA context, process group and imports kept). %%distributed_release ends them.",
    )
    @argument(
        "--max-restarts",
        dest="max_restarts",
        type=options.restarts,
        default=DEFAULT,
        metavar="N",
        help="When a rank fails, stop every rank and start the cell again on all of them, up to N times "
        "(TORCHELASTIC_RESTART_COUNT tells the ranks which attempt it is). Default: 0, "
        "or c.DistributedMagics.default_max_restarts.",
    )
    @argument(
        "--no-watch",
        action="store_true",
        help="Do not watch this cell: no step times per rank, no straggler or hang named (see Watching a run).",
    )
    @argument(
        "--on-hang",
        dest="on_hang",
        choices=ON_HANG,
        default="report",
        help="What a hung rank leads to: report (default: the cell goes on), stop (RankHungError), or restart "
        "(every rank starts again, within --max-restarts).",
    )
    @options.profile()
    @options.memory_history()
    @options.session_flag(
        "--session",
        "Run in session NAME (default: 'default'): the first such cell starts hot ranks, later ones run in the "
        "same processes and namespace, so what a cell assigns or imports is there for the next. Names the session "
        "assigned win over notebook globals. An error in your code keeps the session; Ctrl-C and Cancel raise "
        "KeyboardInterrupt on the ranks and keep it too when they come back. Idle for --keep-alive seconds "
        "(default 3600) it ends. %%distributed_session lists sessions.",
    )
    @options.ranks(
        "With --session: run the cell on these ranks of the session only, such as 0 or 0,2; the result "
        "holds their values in rank order."
    )
    @argument(
        "--out",
        type=options.identifier,
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
    @argument(
        "--detach",
        action="store_true",
        help="Like --background, but the ranks run under a process of their own that outlives this kernel (its "
        "SIGKILL, a restart); air_magic.attach(ID) or %%distributed_attach ID finds the call from any kernel.",
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
        for held in owner().sessions.held_names(settings.session):  # the session's own objects win: never sent again
            program.used_globals.pop(held, None)
        name = "cell" if number is None else f"cell In[{number}]"
        if args.detach:
            detached = owner().detach(settings.spec(program, (), {}, name, origin="cell"))
            if args.out:
                shell.user_ns[args.out] = detached
            return None if args.out or ends_with_semicolon(cell) else detached
        if args.background:
            handle = owner().submit(settings.spec(program, (), {}, name, origin="cell"), BACKGROUND)
            if args.out:
                shell.user_ns[args.out] = handle
            return None if args.out or ends_with_semicolon(cell) else handle
        result = owner().submit(settings.spec(program, (), {}, name, origin="cell")).raise_for_status()
        self.last_result = result
        values = result.values
        if args.out:
            shell.user_ns[args.out] = values
        return None if ends_with_semicolon(cell) else values
