"""What a Ray actor's bare death at a rank's start means: an error that says it, how the worker exited, the tail of
its log, and, where the cause is known, what to change.

Ray reports a worker process that went away as `ActorDiedError` with the
raylet's words. One of its signatures has a usual cause in this launcher: a
rank's worker ended before it ever answered ("Worker unexpectedly exits with a
connection error code 2"), which is what a raylet does to a worker that has not
registered within `RAY_worker_register_timeout_seconds` (60 s by default) on a
node too busy to start it. starting.py asks here when a rank's first answer
fails; worker_log.py finds the dead worker's exit and log; a rank's death later
in a call is pump.py's (`WorkerDiedError`).
"""

from __future__ import annotations

from .placement import LaunchError
from .worker_log import exit_and_log

#: Ray's setting for how long a node waits for a new worker process to register before it kills it.
REGISTER_TIMEOUT_ENV = "RAY_worker_register_timeout_seconds"
#: What the raylet says of a worker whose connection ended (EOF) before it exited properly.
_EOF_SIGNATURE = "connection error code 2"


class WorkerNotRegistered(LaunchError):
    """A rank's Ray worker process died before it answered, as a worker that did not register in time does."""


def never_answered(exc: BaseException) -> bool:
    """`exc` is Ray's bare death of a worker that never answered (what `not_registered` says)."""
    return _actor_died(exc) and _EOF_SIGNATURE in _words(exc)


def not_registered(exc: BaseException) -> WorkerNotRegistered | None:
    """The clear error for `exc` when it is Ray's bare death of a worker that never answered (raise it `from` exc);
    None for any other error."""
    if not never_answered(exc):
        return None
    return WorkerNotRegistered(
        "a rank's Ray worker process died before any code of the call ran, again after it was started once more. "
        f"Ray's own words: {_said(_words(exc))} "
        "Ray ends a worker this way when it has not registered within "
        f"{REGISTER_TIMEOUT_ENV} seconds (60 by default) on a busy node, when the OOM killer ends it, or when it "
        "crashes while it starts; the worker's own log and the node's raylet.out say which. For the first, set "
        f"{REGISTER_TIMEOUT_ENV}=300 in the environment of `ray start` on each node (or of this kernel before "
        f"ray_init() starts Ray here), or give the node less to do.\n{exit_and_log(exc)}".rstrip()
    )


def died_at_start(exc: BaseException) -> LaunchError | None:
    """The clear error for a bare death of a rank's actor before it answered (raise it `from` exc), with the worker's
    exit and log: `not_registered`'s, or one that says Ray's words of any other death; None for no actor's death."""
    if never_answered(exc):
        return not_registered(exc)
    if not _actor_died(exc):
        return None
    return LaunchError(
        f"a rank's Ray actor died before it answered, before any code of the call ran. Ray's own words: "
        f"{_said(_words(exc))}\n{exit_and_log(exc)}".rstrip()
    )


def _actor_died(exc: BaseException) -> bool:
    return "ActorDied" in type(exc).__name__ + _words(exc)


def _words(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _said(text: str) -> str:
    """Ray's words from its sentence about the actor (a raylet's preamble before it repeats them)."""
    return (text[text.find("The actor") :] if "The actor" in text else text)[:1500]
