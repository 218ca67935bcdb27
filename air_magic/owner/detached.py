"""`python -m air_magic.owner.detached RUN_DIR`: a detached call's owner process, an owner like a kernel.

The call's hand-off and its end are calls/detached.py's; this entry point gives that process its one owner (with the
role its starter named: "detached" from a notebook, "cli" from the command line), whose door the call goes through.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..calls.detached import main
from .owner import owner


def submit_as(role: str) -> Callable[..., Any]:
    """This process's owner, in `role`, and its one door."""
    return owner(role).submit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], submit_as))
