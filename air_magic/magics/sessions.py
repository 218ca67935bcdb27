"""The magics of kept ranks: %distributed_session lists, ends or resets sessions, %distributed_push and
%distributed_pull move values in and out of one, %distributed_release ends every hot rank. The logic is
the owner's (air_magic/owner/: its sessions and launchers)."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..calls import session_table
from ..owner import owner
from . import options


@magics_class
class SessionMagics(Magics):
    """%distributed_session, %distributed_push, %distributed_pull and %distributed_release."""

    @line_magic
    def distributed_release(self, line: str = "") -> None:
        """End every hot rank of this kernel now (see --keep-alive), sessions included; their GPU memory is freed."""
        owner().launchers.release_hot()
        for said in owner().sessions.released():
            print(said)

    @magic_arguments()
    @options.session("The session to send the values to. Default: 'default'.")
    @options.ranks("Only these ranks, such as 0 or 0,2.")
    @argument("names", nargs="+", type=options.identifier, metavar="VARIABLE", help="Notebook variables to send.")
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
        owner().sessions.push(args.session, {name: shell.user_ns[name] for name in args.names}, args.ranks)

    @magic_arguments()
    @options.session("The session to read from. Default: 'default'.")
    @options.rank("One rank's value instead of a list by rank.")
    @argument("name", type=options.identifier, metavar="VARIABLE", help="The name on the ranks.")
    @line_magic
    def distributed_pull(self, line: str = "") -> Any:
        """Bring a value back from a session's ranks: a list by rank, or one rank's value with --rank R.

        losses = %distributed_pull losses
        model_state = %distributed_pull --rank 0 state
        """
        args = parse_argstring(self.distributed_pull, line)
        return owner().sessions.pull(args.session, args.name, args.rank)

    @magic_arguments()
    @options.session_flag("--end", "End session NAME's ranks (default: 'default'); what they hold is lost.")
    @options.session_flag("--reset", "Empty session NAME's namespaces; the processes and process group stay.")
    @line_magic
    def distributed_session(self, line: str = "") -> None:
        """List the live sessions (ranks, pids, node, device, memory, idle time left, names) and Ray's other kept
        actors (hot ranks, spares: what they hold, how long), or end or reset a session."""
        args = parse_argstring(self.distributed_session, line)
        if args.end is not None:
            print(owner().sessions.end(args.end))
        elif args.reset is not None:
            owner().sessions.reset(args.reset)
            print(f"session {args.reset!r}: every rank's namespace is empty; its processes stay.")
        else:
            print(session_table.table(owner().sessions, owner().launchers))
