"""What a rank changes in torch.distributed: process groups held while it runs, and a hot rank's kept group.

Both patch `init_process_group` / `destroy_process_group` in the rank's process. Not for running a call (worker.py)
or a hot rank's loop over calls (hot.py).
"""

from __future__ import annotations

import sys

#: Process groups the user's code destroyed, referenced until the rank ends (see hold_destroyed_groups).
_destroyed_groups: list[object] = []


def hold_destroyed_groups() -> None:
    """Keep each process group that `destroy_process_group()` ends referenced until the rank process ends.

    torch's gloo backend joins its worker threads in its destructor while the caller holds the GIL, and a
    worker thread that is still releasing a finished collective's tensors waits for the GIL: a deadlock.
    After `destroy_process_group()` the last reference to the group is usually a DDP model's, dropped when
    the user's function returns, so the rank hung right after its function had finished (seen under load
    with a DCP checkpoint's broadcast: `~Reducer` -> `~ProcessGroupGloo` -> `thread::join` on one side,
    `~AsyncWork` -> `gil_scoped_acquire` on the other). Held here, a destroyed group is never torn down
    while the rank runs; the rank ends with os._exit (`finish`) or with its Ray actor. Patched once per
    process, and only where torch.distributed is already imported (the preload imports it).
    """
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or getattr(c10d.destroy_process_group, "holds_groups", False):
        return
    destroy = c10d.destroy_process_group

    def destroy_process_group(group: object = None) -> None:
        world = group is None or group is c10d.GroupMember.WORLD
        ending = list(getattr(getattr(c10d, "_world", None), "pg_map", {})) if world else [group]
        _destroyed_groups.extend(g for g in ending if g is not None and all(g is not h for h in _destroyed_groups))
        return destroy(group)  # type: ignore[arg-type]

    destroy_process_group.holds_groups = True  # type: ignore[attr-defined]
    dist = sys.modules["torch.distributed"]
    for module in (dist, c10d):
        setattr(module, "destroy_process_group", destroy_process_group)  # noqa: B010 - patched on purpose


def keep_process_group() -> None:
    """In a hot rank: `init_process_group()` returns with the group that exists, `destroy_process_group()` keeps it.

    Another backend than the one the group has is a clear error, not a silent second group.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not dist.is_available():
        return
    c10d = dist.distributed_c10d
    init, destroy = c10d.init_process_group, c10d.destroy_process_group

    def init_process_group(backend: object = None, *args: object, **kwargs: object) -> None:
        if not dist.is_initialized():
            return init(backend, *args, **kwargs)  # type: ignore[arg-type]
        have = str(dist.get_backend()).lower()
        if backend is not None and str(backend).lower() not in have:
            raise ValueError(
                f"this hot rank already holds a {have!r} process group, so init_process_group({backend!r}) cannot "
                "make another; use the same backend in every call, or release the hot ranks (%distributed_release "
                "or the panel's Release button) to start fresh ones."
            )
        return None

    def destroy_process_group(group: object = None) -> None:
        if group is None or group is c10d.GroupMember.WORLD:
            return None  # kept for the next call; it ends with the hot rank
        return destroy(group)  # type: ignore[arg-type]

    for module in (dist, c10d):
        setattr(module, "init_process_group", init_process_group)  # noqa: B010 - patched on purpose
        setattr(module, "destroy_process_group", destroy_process_group)  # noqa: B010
