"""The magics of a call that outlives its cell: %distributed_calls lists them, %distributed_show draws one's panel,
%distributed_stop asks one to stop after its step. The calls themselves are background.py's and stopping.py's."""

from __future__ import annotations

from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import magic_arguments, parse_argstring

from ..errors import AirMagicError, ConfigurationError
from . import options


def _number(text: str | None) -> int | None:
    """A background call's small number (%distributed_calls), as typed."""
    if text is None:
        return None
    if not text.isdigit():
        raise UsageError(f"expected a call's id such as 3, got {text!r}")
    return int(text)


@magics_class
class CallMagics(Magics):
    """%distributed_calls, %distributed_show and %distributed_stop."""

    @line_magic
    def distributed_calls(self, line: str = "") -> None:
        """List this kernel's background calls: id, function or cell, status, ranks, GPUs, started, elapsed, MLflow."""
        from .. import background

        print(background.table())

    @magic_arguments()
    @options.call_id("The call's id (%%distributed_calls). Default: the latest.")
    @line_magic
    def distributed_show(self, line: str = "") -> None:
        """Draw a background call's panel in this cell: live, with every line its ranks wrote so far, while it runs;
        its record once it ended."""
        from .. import background

        args = parse_argstring(self.distributed_show, line)
        try:
            call = background.find(_number(args.id))
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

        args = parse_argstring(self.distributed_stop, line)
        run_dir: Path | None = None
        try:
            run_dir = stopping.find_call(args.id)
        except LookupError as exc:
            if args.id is None or args.id.isdigit():
                from .. import background

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
