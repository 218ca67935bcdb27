"""`%distributed_calls` as text: one line per call of this process's table (calls/table.py), by number.

Not for: finding a call (calls/table.py) or drawing one's panel (follow.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..job import CallStatus
from ..launch.files import debug_channel

if TYPE_CHECKING:
    from ..calls.handle import DistributedCall

#: What `table` says before the first call.
NO_CALL = "No background call in this kernel yet: start one with fn.spawn(...) or %%distributed --background."


def table(calls: list[DistributedCall]) -> str:
    """Number, function or cell, status (what a waiting call waits for, a rank at a breakpoint), ranks, GPUs,
    when it started, how long it has run, and its MLflow link; one line per call, oldest first."""
    if not calls:
        return NO_CALL
    lines = ["id  call                      status     ranks  GPUs      started   elapsed  MLflow"]
    for call in calls:
        units = call.claim.units if call.claim is not None and call.spec.uses_gpu else None
        gpus = ",".join(units) if units else "-"
        when = time.strftime("%H:%M:%S", time.localtime(call.started))
        status = call.status + (f" (for {call.waiting_for})" if call.status == CallStatus.WAITING else "")
        if call.status == CallStatus.RUNNING and call.ctx is not None:
            note = debug_channel.waiting_note(set(debug_channel.waiting(call.ctx.run_dir, call.spec.world_size)))
            status += f" · {note}" if note else ""
        lines.append(
            f"{call.number:<3} {call.spec.name[:25]:<25} {status:<10} {call.spec.world_size:<6} {gpus:<9} {when}  "
            f"{call.elapsed:>6.0f} s  {call.link or '-'}"
        )
    return "\n".join(lines)
