"""What a Ray actor's bare death means, where the cause is known: an error that says it and what to change.

Ray reports a worker process that went away as `ActorDiedError` with the
raylet's words. One of its signatures has a usual cause in this launcher: a
rank's worker ended before it ever answered ("Worker unexpectedly exits with a
connection error code 2"), which is what a raylet does to a worker that has not
registered within `RAY_worker_register_timeout_seconds` (60 s by default) on a
node too busy to start it. starting.py asks here when a rank's first answer
fails; a rank's death later in a call is pump.py's (`WorkerDiedError`).
"""

from __future__ import annotations

from .placement import LaunchError

#: Ray's setting for how long a node waits for a new worker process to register before it kills it.
REGISTER_TIMEOUT_ENV = "RAY_worker_register_timeout_seconds"
#: What the raylet says of a worker whose connection ended (EOF) before it exited properly.
_EOF_SIGNATURE = "connection error code 2"


class WorkerNotRegistered(LaunchError):
    """A rank's Ray worker process died before it answered, as a worker that did not register in time does."""


def not_registered(exc: BaseException) -> WorkerNotRegistered | None:
    """The clear error for `exc` when it is Ray's bare death of a worker that never answered (raise it `from` exc);
    None for any other error."""
    text = " ".join(str(exc).split())
    if "ActorDied" not in type(exc).__name__ + text or _EOF_SIGNATURE not in text:
        return None
    said = text[text.find("The actor") :] if "The actor" in text else text
    return WorkerNotRegistered(
        "a rank's Ray worker process died before any code of the call ran, again after it was started once more. "
        f"Ray's own words: {said[:1500]} "
        "Ray ends a worker this way when it has not registered within "
        f"{REGISTER_TIMEOUT_ENV} seconds (60 by default) on a busy node, when the OOM killer ends it, or when it "
        "crashes while it starts; the node's Ray logs (raylet.out, worker-*.err) say which. For the first, set "
        f"{REGISTER_TIMEOUT_ENV}=300 in the environment of `ray start` on each node (or of this kernel before "
        "ray_init() starts Ray here), or give the node less to do"
    )
