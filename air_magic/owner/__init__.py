"""The owner of calls: one object per process that makes calls (a kernel, an `air-magic` process, a detached call's
owner process), holding its table of calls, keeper of kept worlds, ledger, sessions and launchers, with `submit` as
the only way in (owner.py). A call's claim on the ledger is claims.py. The front doors (decorator.py, magics/, cli/,
`air_magic.attach`) reach the process's owner with `owner()`; nothing below this package imports it.
"""

from __future__ import annotations

from pathlib import Path

from ..calls.handle import DistributedCall
from .owner import BACKGROUND, DETACHED, FOREGROUND, MODES, Owner, owner

__all__ = ["BACKGROUND", "DETACHED", "FOREGROUND", "MODES", "Owner", "attach", "owner"]


def attach(call_id: str | Path, show: bool = True) -> DistributedCall:
    """The handle of call `call_id` (its id, a unique prefix of it, or its run directory), which any process of
    this user on this machine may run: a detached call, a command-line run or another kernel's call.

    In a notebook its live panel is drawn here, with every line so far (`show=False`: not). `.result()`,
    `.cancel()`, `.stop()`, `.logs(rank)` and `.show()` work as on the handle of a call started here. The call is in
    this process's table of calls from now on (`%distributed_calls`).
    """
    from ..calls.attached import attach as attach_to

    return attach_to(str(call_id), show, owner())
