"""NVML (nvidia-ml-py), started once per process, and which processes hold memory on which GPU.

`session()` is pynvml with NVML initialized, or None without nvidia-ml-py or a driver (a caller then reads CPU and
memory only). `gpu_memory_of(pids)` is what those processes hold on each GPU, from NVML's list of compute processes:
how a node's watch learns which GPU a rank that its command's own launcher started took (cli/command_watch.py). The
notebook's sampler knows each rank's GPU from the call and reads the device (resources.py). Never initializes CUDA.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

_lock = threading.Lock()
_state: list[Any] = []  # [pynvml] once NVML is up in this process, [None] once it could not be


def session() -> Any:
    """pynvml with NVML initialized, once per process (a caller never pays for its start or shutdown), or None."""
    with _lock:
        if not _state:
            try:
                import pynvml

                pynvml.nvmlInit()
            except Exception:  # noqa: BLE001 - not installed, no driver: CPU and memory only
                _state.append(None)
            else:
                _state.append(pynvml)
        return _state[0]


def gpu_memory_of(pids: Iterable[int]) -> dict[int, int]:
    """Bytes the processes `pids` hold on each GPU, by GPU index as nvidia-smi numbers them; {} without NVML.

    A process whose memory NVML cannot read (some containers) counts 0 on its GPU, so its GPU is still named."""
    pynvml = session()
    wanted = set(pids)
    if pynvml is None or not wanted:
        return {}
    held: dict[int, int] = {}
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError:
        return {}
    for index in range(count):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLError:
            continue
        for proc in processes:
            if proc.pid in wanted:
                held[index] = held.get(index, 0) + int(proc.usedGpuMemory or 0)
    return held
