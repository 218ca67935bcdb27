"""The options of air_magic's magics, each declared once: its type (text -> value, with a clear error) and, for an
option several magics share, its declaration (`call_id`, `session`, `ranks`, ...).

A magic lists its options as IPython's `magic_arguments` decorators; an option one magic alone takes is declared at
that magic. A new option shared by several magics is one function here returning `argument(...)`, so its name, type
and metavar cannot drift apart between magics; only its help may differ.
"""

from __future__ import annotations

import argparse
import keyword
from typing import Any

from IPython.core.magic_arguments import argument

from ..calls import sessions
from ..decorator import check_keep_alive, check_max_restarts, check_timeout
from ..errors import ConfigurationError

#: An option the cell did not give: the configured default applies (`given`).
DEFAULT: Any = object()


def given(value: Any, default: Any) -> Any:
    """`value`, or `default` where the option was not given (DEFAULT)."""
    return default if value is DEFAULT else value


# -- types: the text of an option -> its value ---------------------------------------------
def _at_least_one(text: str, of: str) -> int:
    """A whole number of at least 1 (`of`: what is counted, "worker" or "machine"), or the error that says so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of {of}s such as 2, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 {'node' if of == 'machine' else of}, got {value}")
    return value


def count(text: str) -> int:
    return _at_least_one(text, "worker")


def nodes(text: str) -> int:
    return _at_least_one(text, "machine")


def seconds(text: str) -> float | None:
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


def keep_alive(text: str) -> float | None:
    try:
        return check_keep_alive(float(text))
    except (ValueError, ConfigurationError):
        raise argparse.ArgumentTypeError(f"expected seconds more than 0 such as 600, got {text!r}") from None


def restarts(text: str) -> int:
    try:
        return check_max_restarts(int(text))
    except (ValueError, ConfigurationError):
        raise argparse.ArgumentTypeError(
            f"expected a whole number of restarts, 0 or more, such as 2, got {text!r}"
        ) from None


def profile_steps(text: str) -> int:
    """The text of --profile: a whole number of steps, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of steps to profile, 1 or more, such as 5, got {text!r}"
        )
    return value


def rank_list(text: str) -> tuple[int, ...]:
    """The text of --ranks as rank numbers; whether they fit a session is Settings' check (sessions.check_ranks)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rank numbers such as 0 or 0,2, got {text!r}") from None


def session_name(text: str) -> str:
    try:
        return sessions.check_name(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def identifier(text: str) -> str:
    if not text.isidentifier() or keyword.iskeyword(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid Python variable name")
    return text


def call_id_text(text: str) -> str:
    """A call's id as typed: its small number, its run directory's name (or a unique start of it), or its path."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a call's id such as 3 or its run directory's name")
    return text.strip()


# -- options several magics share ------------------------------------------------------------
def call_id(help: str, required: bool = False) -> Any:
    """The positional ID of the magics that act on one call (`args.id`, None when not given; `required`: must be)."""
    if required:
        return argument("id", type=call_id_text, metavar="ID", help=help)
    return argument("id", nargs="?", type=call_id_text, default=None, metavar="ID", help=help)


def session(help: str, default: str | None = sessions.DEFAULT_SESSION) -> Any:
    """--session NAME of the line magics that act on one session (`args.session`)."""
    return argument("--session", default=default, type=session_name, metavar="NAME", help=help)


def session_flag(flag: str, help: str) -> Any:
    """An option naming a session that may be given bare for the default one: `--end`, `--session` of a cell."""
    return argument(
        flag, nargs="?", const=sessions.DEFAULT_SESSION, default=None, type=session_name, metavar="NAME", help=help
    )


def ranks(help: str) -> Any:
    """--ranks R: some ranks of a session (`args.ranks`, None for all)."""
    return argument("--ranks", type=rank_list, default=None, metavar="R", help=help)


def rank(help: str) -> Any:
    """--rank R: one rank (`args.rank`, None when not given)."""
    return argument("--rank", type=int, default=None, metavar="R", help=help)


# -- options of the cell magic alone, declared here so that execution.py stays glue -----------------------------
def profile() -> Any:
    """--profile N: profile N steps of every rank with torch.profiler (`args.profile`, None when not given)."""
    return argument(
        "--profile",
        type=profile_steps,
        default=None,
        metavar="N",
        help="Profile N steps of every rank with torch.profiler (from its third step; a step is the watch's): the "
        "table of each rank's compute, collective, input and idle time per step, the slowest rank and why, and the "
        "traces (one merged, a process per rank) follow the cell's output; JobResult.profile holds them.",
    )


def memory_history() -> Any:
    """--memory-history: GPU ranks keep CUDA's allocation history (`args.memory_history`)."""
    return argument(
        "--memory-history",
        dest="memory_history",
        action="store_true",
        help="GPU ranks keep CUDA's allocation history with Python stacks: an out-of-memory error then names the "
        "largest live allocations and writes a snapshot for PyTorch's memory viewer.",
    )
