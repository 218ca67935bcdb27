"""The only place air_magic touches Ray's private names; each use says what it falls back to without it.

pyproject.toml's `ray` extra allows the Ray versions these were checked
against (`RAY_VERSIONS`, the range of `ray[default]` there; 2.60 is what the
tests run). A Ray outside it may have moved or renamed them: every function
here then degrades (no wait, no "free now" figures, the loopback setting only
through the environment) rather than failing a call.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

#: The Ray versions pyproject.toml's `ray` extra allows (keep the two in step).
RAY_VERSIONS = ">=2.50,<2.61"


def actor_id(actor: Any) -> str:
    """An actor handle's id, as the state API names it."""
    return str(actor._actor_id.hex())


def actor_states(ids: list[str]) -> list[str] | None:
    """The state ("ALIVE", "DEAD", ...) of each actor id; None where the state API is not there or changed."""
    try:
        from ray._private.state import actors as actor_table

        return [str(actor_table(actor_id=i).get("State")) for i in ids]
    except Exception:  # noqa: BLE001 - a state API that changed: nothing to wait on
        return None


def free_per_node() -> dict[str, dict[str, float]] | None:
    """Node id -> resources free on it now; None where Ray no longer offers it."""
    try:
        from ray._private.state import available_resources_per_node

        return dict(available_resources_per_node())
    except Exception:  # noqa: BLE001
        return None


@contextlib.contextmanager
def cluster_mode_off() -> Iterator[None]:
    """While Ray starts here: the already imported Ray reads `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` as set.

    The processes Ray starts read the variable at their import; this process read it when it imported Ray,
    into a private constant, which is set for the duration.
    """
    constants = sys.modules.get("ray._private.ray_constants")
    was = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if constants is not None:
        setattr(constants, "ENABLE_RAY_CLUSTER", False)  # noqa: B010
    try:
        yield
    finally:
        if constants is not None and was is not None:
            setattr(constants, "ENABLE_RAY_CLUSTER", was)  # noqa: B010


def upload_py_modules(paths: list[str]) -> list[str]:
    """Upload local directories for a runtime environment's `py_modules`; their URIs, usable by any actor.

    Ray uploads local `py_modules` only for the job's own runtime environment (at `ray.init`); an actor's
    must name URIs, which this makes with the same helper (content-addressed: the same files, the same URI).
    """
    import tempfile

    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed

    with tempfile.TemporaryDirectory(prefix="air_magic-py-modules-") as scratch:
        env = upload_py_modules_if_needed({"py_modules": list(paths)}, include_gitignore=False, scratch_dir=scratch)
    return [str(uri) for uri in env["py_modules"]]


def local_session() -> tuple[str, str] | None:
    """This process's Ray node: its session directory and ip address; None where Ray is not connected here (or no
    longer says them: then a dead worker's log is named, not read)."""
    worker = sys.modules.get("ray._private.worker")  # not imported: Ray never ran in this process
    try:
        node = worker._global_node  # type: ignore[union-attr]
        return str(node.get_session_dir_path()), str(node.node_ip_address)
    except Exception:  # noqa: BLE001
        return None


def actor_worker(actor_id: str) -> dict[str, Any] | None:
    """The worker process an actor (id in hex) ran in, from the cluster's actor table: its pid, worker_id, node_id
    and ip; None where Ray is not connected here or its table changed (a dead worker is then named by Ray's words
    alone)."""
    if "ray._private.worker" not in sys.modules:
        return None
    try:
        import ray
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        raw = state._connect_and_get_accessor().get_actor_info(ray.ActorID(bytes.fromhex(actor_id)))
        if raw is None:
            return None
        data = gcs_pb2.ActorTableData.FromString(raw)  # type: ignore[attr-defined]
        address = data.address
        return {
            "pid": int(data.pid),
            "worker_id": address.worker_id.hex(),
            "node_id": address.node_id.hex(),
            "ip": str(address.ip_address),
        }
    except Exception:  # noqa: BLE001
        return None
