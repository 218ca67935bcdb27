"""The magics of calls: %distributed_calls lists this process's calls, %distributed_show draws one's panel,
%distributed_stop asks one to stop after its step. Each finds its call one way, in the table of calls
(calls/table.py, through `calls.handle.find`); the calls themselves are calls/handle.py's and stopping.py's."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..errors import AirMagicError, ConfigurationError
from ..owner import owner
from . import options


@magics_class
class CallMagics(Magics):
    """%distributed_calls, %distributed_attach, %distributed_show and %distributed_stop."""

    @magic_arguments()
    @argument(
        "--all",
        action="store_true",
        help="Every call of this user on this machine (every kernel's, detached ones, the command line's), read "
        "from the run directories.",
    )
    @line_magic
    def distributed_calls(self, line: str = "") -> None:
        """List this kernel's calls, background and foreground: number, function or cell, status, ranks, GPUs,
        started, elapsed, MLflow."""
        from ..calls.handle import calls

        if parse_argstring(self.distributed_calls, line).all:
            from ..calls.attached import machine_table

            print(machine_table())
            return
        from ..display.calls import table

        print(table(calls(owner().table)))

    @magic_arguments()
    @options.call_id("The call's id (%%distributed_calls --all; a unique start of it is enough).", required=True)
    @line_magic
    def distributed_attach(self, line: str = "") -> object:
        """Attach to a call of any process of this user on this machine (a detached call, another kernel's, the
        command line's): draw its live panel here with every line so far, and return its DistributedCall.

            h = %distributed_attach 20260105-101500-train
        """
        from ..owner import attach

        args = parse_argstring(self.distributed_attach, line)
        try:
            return attach(args.id)
        except AirMagicError as exc:
            raise UsageError(str(exc)) from None

    @magic_arguments()
    @options.call_id("The call's id (%%distributed_calls). Default: the latest.")
    @line_magic
    def distributed_show(self, line: str = "") -> None:
        """Draw a background call's panel in this cell: live, with every line its ranks wrote so far, while it runs;
        its record once it ended."""
        from ..calls.handle import find

        args = parse_argstring(self.distributed_show, line)
        try:
            call = find(owner().table, args.id)
        except ConfigurationError as exc:
            raise UsageError(str(exc)) from None
        call.show()

    @magic_arguments()
    @options.call_id(
        "The call to stop: a background call's id (%%distributed_calls), or its run directory's name. "
        "Default: the call running now, else the latest background call."
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
        from .. import stopping
        from ..calls.handle import calls, find

        args = parse_argstring(self.distributed_stop, line)
        known = calls(owner().table)
        running = [call for call in known if not call.done()]
        if args.id is None and not known:
            raise UsageError("no call is running in this kernel, so there is nothing to stop.")
        try:
            call = running[-1] if args.id is None and running else find(owner().table, args.id)
            if call.done():
                raise UsageError(f"call {call.short} has ended ({call.status}): there is nothing to stop.")
            run_dir = call.run_dir
        except AirMagicError as exc:
            raise UsageError(str(exc)) from None
        if stopping.request_stop(run_dir):
            print(f"asked {run_dir.name} to stop after this step: should_stop() is True on every rank from now on.")
        else:
            print(f"{run_dir.name} was already asked to stop.")
