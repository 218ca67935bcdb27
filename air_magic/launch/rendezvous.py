"""The rendezvous store of one job, served from its own small process on 127.0.0.1.

The supervisor binds a socket to 127.0.0.1 and hands its descriptor to this
process, which serves a `torch.distributed.TCPStore` on it until it is
killed. Ranks join as clients (TORCHELASTIC_USE_AGENT_STORE), so no rank
opens a listening socket on another interface for the rendezvous. Keeping
the store out of the supervisor keeps the supervisor free of threads, which
lets it fork warm workers safely.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

from .stopper import die_with_parent

#: The descriptor the listening socket arrives on in a spawned store process.
STORE_FD = 3


def serve(fd: int, port: int, world_size: int) -> None:
    """Serve the store on listening socket `fd` until killed (or until the supervisor dies)."""
    die_with_parent()
    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1",
        port,
        world_size,
        True,
        timedelta(minutes=30),
        wait_for_workers=False,
        master_listen_fd=fd,
        use_libuv=False,
    )
    try:
        while True:
            signal.pause()
    finally:
        del store


def main() -> None:
    serve(STORE_FD, int(sys.argv[1]), int(sys.argv[2]))
    os._exit(0)
