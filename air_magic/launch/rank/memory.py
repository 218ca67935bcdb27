"""Inside a GPU rank: CUDA's allocation history, what an out-of-memory error says and leaves, and the call's peak.

With `memory_history=True` (`--memory-history`) the rank asks torch to keep a
bounded history of its CUDA allocations with their Python stacks
(`_record_memory_history`, at most `MAX_ENTRIES` events), and attaches an
out-of-memory observer, which torch calls before the error unwinds: it
writes the snapshot (`rank-N.memory.pickle`, PyTorch's memory viewer opens
it) and notes the largest live allocation sites (launch/files/memory_snapshot.py).
Both wait for CUDA's own start (`torch.cuda._lazy_call`), so that a rank
that never uses CUDA gets no context, and one that picks its device first
gets none on another GPU.

Whatever the setting, a `torch.OutOfMemoryError` raised in the rank gets a note
naming the rank and its allocated, reserved and free memory (and, with the
history, the sites and the snapshot's path), and a rank that used CUDA
leaves its peak allocated memory of the call (`rank-N.memory.json`).
Imports torch only where the rank already has.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..files import memory_snapshot as f
from ..files.memory_snapshot import human_bytes

#: Allocation events the history keeps at most (its memory is bounded; the oldest go first).
MAX_ENTRIES = 100_000

_snapshot_path: Path | None = None
_peak_path: Path | None = None
_rank = 0
_observed = False
#: What the observer saw at the last out-of-memory error: (device, bytes asked, allocated, free, sites).
_oom: tuple[int, int, int, int, list[f.Site]] | None = None


def start(rank: int, snapshot: Path, peak: Path, history: bool) -> None:
    """Before the call: its peak counts from now, and with `history` CUDA's allocation history is kept."""
    global _snapshot_path, _peak_path, _rank, _oom
    _rank, _snapshot_path, _peak_path, _oom = rank, snapshot, peak, None
    loaded = sys.modules.get("torch")
    if loaded is not None and loaded.cuda.is_initialized():
        loaded.cuda.reset_peak_memory_stats()  # a hot rank: this call's peak, not the last one's
    if history:
        import torch

        if torch.cuda.is_available():
            torch.cuda._lazy_call(_keep_history)


def _keep_history() -> None:
    global _observed
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    if not _observed:
        _observed = True
        torch._C._cuda_attach_out_of_memory_observer(_observer)  # type: ignore[attr-defined]


def _observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    """torch's out-of-memory observer: the snapshot is written before the error unwinds the frames holding memory."""
    global _oom
    import torch

    try:
        snapshot = torch.cuda.memory._snapshot()
        sites = f.top_sites(snapshot, device=device)
        if _snapshot_path is not None:
            torch.cuda.memory._dump_snapshot(str(_snapshot_path))
    except Exception:  # noqa: BLE001 - the rank's own error matters more than its snapshot
        sites = []
    _oom = (device, alloc, device_allocated, device_free, sites)


def explain(exc: BaseException) -> None:
    """Add to a `torch.OutOfMemoryError` the note that says what filled the memory (see the module)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is None or not isinstance(exc, oom_type) or not torch.cuda.is_initialized():
        return
    try:
        device = torch.cuda.current_device() if _oom is None else _oom[0]
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)
    except Exception:  # noqa: BLE001 - a GPU that cannot say: the error as it is
        return
    lines = [
        f"air_magic: rank {_rank} ran out of GPU memory on cuda:{device}: {human_bytes(allocated)} allocated, "
        f"{human_bytes(reserved)} reserved, {human_bytes(free)} free of {human_bytes(total)}"
        + (f" when {human_bytes(_oom[1])} more was asked for" if _oom is not None else "")
        + "."
    ]
    if _oom is not None and _oom[4]:
        lines.append(f"The {len(_oom[4])} largest live allocation sites (file, line, function, size):")
        lines += [f"  {site.text()}" for site in _oom[4]]
    if _oom is not None and _snapshot_path is not None and _snapshot_path.exists():
        lines.append(f"Snapshot: {_snapshot_path} (open it at https://pytorch.org/memory_viz)")
    elif _oom is None:
        lines.append(
            "Pass memory_history=True (%%distributed --memory-history) to see the largest live allocations and get "
            "a snapshot of the rank's memory."
        )
    exc.add_note("\n".join(lines))


def finish() -> None:
    """After the call: the rank's peak allocated and reserved memory, when it used CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or _peak_path is None or not torch.cuda.is_initialized():
        return
    try:
        device = torch.cuda.current_device()
        f.write_peak(
            _peak_path, device, torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        )
    except Exception:  # noqa: BLE001, S110 - no peak said is better than a rank that fails at its end
        pass
