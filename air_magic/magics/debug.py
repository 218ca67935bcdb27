"""%distributed_debug: pdb on a rank, a post-mortem of a session's last error or a rank waiting at breakpoint().
The debugger's plumbing is air_magic/calls/debugging.py."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import magic_arguments, parse_argstring

from ..calls import sessions
from ..errors import ConfigurationError
from ..owner import owner
from . import options


@magics_class
class DebugMagics(Magics):
    """%distributed_debug."""

    @magic_arguments()
    @options.rank(
        "The rank to debug. Default: the first that raised (post-mortem), or the first waiting at a breakpoint."
    )
    @options.session("Post-mortem on this session's last error. Default: 'default'.", default=None)
    @options.call_id(
        "Attach to a rank waiting at a breakpoint in this call: a background call's id (%%distributed_calls), "
        "its run directory, or part of the directory's name."
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
        from ..calls import debugging

        args = parse_argstring(self.distributed_debug, line)
        try:
            if args.id is not None:  # a call's number (%distributed_calls), id, or run directory
                debugging.attach(debugging.find_waiting(owner().table, args.id), args.rank)
                return
            if args.session is None:
                try:
                    waiting = debugging.find_waiting(owner().table)
                except ConfigurationError:
                    waiting = None
                if waiting is not None:
                    debugging.attach(waiting, args.rank)
                    return
            owner().sessions.post_mortem(args.session or sessions.DEFAULT_SESSION, args.rank)
        except ConfigurationError as exc:
            raise UsageError(str(exc)) from None
