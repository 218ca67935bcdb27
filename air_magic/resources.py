"""What each rank uses while a call runs (CPU, memory, its GPU), sampled from the notebook process.

`ResourceSampler` is a runner listener. From the pid each rank starts with
(`RunContext.pids`), a daemon thread samples about once a second: the rank's
CPU % and resident memory, both summed over the rank and all its children
(DataLoader workers, compile workers), and, when nvidia-ml-py finds a driver,
the utilization and memory of the rank's GPU. It keeps the latest sample and
each rank's peak, which the panel and the static record read, and hands a
sample every `LOG_EVERY` seconds (and the last one and the peaks at the end)
to its sinks, such as the MLflow tracker's `log_system_metrics`.

Which GPU a rank uses: a local rank gets LOCAL_RANK = its rank and the
CUDA_VISIBLE_DEVICES of the call (the call's own, else the notebook's), so
rank r uses the r-th entry of that list (an index or a GPU-UUID), or GPU r
when it is unset. NVML numbers GPUs in PCI bus order, as CUDA does with
CUDA_DEVICE_ORDER=PCI_BUS_ID (on servers with one GPU model both orders
agree). A GPU's memory is the device's, not the rank's: a GPU that several
ranks or other programs share shows them all.

NVML is read here and CUDA is never initialized. Without nvidia-ml-py, a
driver, or a GPU call, only CPU and memory are sampled. The ranks of a call
across several nodes (Ray) are processes of other machines: each is sampled
on its node (CPU and memory) and its figures arrive with its output
(launch/files/rank_files.py's usage file); their GPUs are not read yet. Sampling
never blocks the call: it runs on its own thread and
`psutil.cpu_percent(interval=None)` does not sleep.

Imports neither ipywidgets nor mlflow: the display and the tracking read it.

Over 300 lines because sampling CPU, memory and GPU use of the ranks, and the GPU's own readings, is one concern with
many small parts (a process tree's figures: launch/tree_usage.py).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from .job import JobResult, JobSpec
from .launch import nvml
from .launch.files.rank_files import read_usage
from .launch.files.rundir import RunDir
from .launch.tree_usage import TreeUsage
from .listeners import Listener, RunContext

#: Seconds between two samples.
PERIOD = 1.0
#: Seconds between two looks for the ranks' processes until the first of them is sampled.
FIRST = 0.2
#: Seconds between two samples handed to the sinks (MLflow): sampled, not one per training step.
LOG_EVERY = 5.0
#: Fraction of a device's (or the node's) memory in use from which the panel warns.
NEAR_LIMIT = 0.9

#: Receives {metric name: value} and a step (seconds since the call started); called from the sampler's thread.
Sink = Callable[[dict[str, float], int], None]


@dataclass(frozen=True)
class Usage:
    """One rank at one moment: CPU % (100 = one core), resident bytes, and its GPU's figures when known."""

    cpu_percent: float
    memory: int
    gpu: str | None = None
    gpu_percent: float | None = None
    gpu_memory: int | None = None
    gpu_memory_total: int | None = None


@dataclass
class Peak:
    """The most a rank used over the samples taken: resident bytes, and its GPU's memory."""

    memory: int = 0
    gpu_memory: int | None = None

    def add(self, usage: Usage) -> None:
        self.memory = max(self.memory, usage.memory)
        if usage.gpu_memory is not None:
            self.gpu_memory = max(self.gpu_memory or 0, usage.gpu_memory)


# -- words --------------------------------------------------------------------------
def size_text(n: int) -> str:
    """Bytes in the unit people read: '412 MiB', '1.28 GiB', '61.2 GiB'."""
    if n >= 10 * 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB"


def usage_text(usage: Usage) -> str:
    """'CPU 98% · memory 412 MiB · GPU 3: 87% · 61.2 GiB / 80.0 GiB'."""
    text = f"CPU {usage.cpu_percent:.0f}% · memory {size_text(usage.memory)}"
    if usage.gpu is not None and usage.gpu_memory is not None:
        total = f" / {size_text(usage.gpu_memory_total)}" if usage.gpu_memory_total else ""
        busy = f"{usage.gpu_percent:.0f}% · " if usage.gpu_percent is not None else ""
        text += f" · GPU {usage.gpu}: {busy}{size_text(usage.gpu_memory)}{total}"
    return text


def peak_text(peak: Peak) -> str:
    """'peak memory 412 MiB' (and '· GPU memory peak 61.2 GiB' on GPUs)."""
    text = f"peak memory {size_text(peak.memory)}"
    if peak.gpu_memory is not None:
        text += f" · GPU memory peak {size_text(peak.gpu_memory)}"
    return text


def busiest_gpu(latest: dict[int, Usage]) -> Usage | None:
    """The sample of the GPU whose memory is fullest, or None when no GPU was sampled."""
    gpus = [u for u in latest.values() if u.gpu_memory is not None and u.gpu_memory_total]
    return max(gpus, key=lambda u: (u.gpu_memory or 0) / (u.gpu_memory_total or 1), default=None)


def header_text(latest: dict[int, Usage], node_memory_percent: float | None) -> tuple[str, bool]:
    """(words for the panel's header, near the limit?): the fullest GPU's memory, else the ranks' memory together."""
    gpu = busiest_gpu(latest)
    if gpu is not None:
        used, total = gpu.gpu_memory or 0, gpu.gpu_memory_total or 1
        return f"GPU {gpu.gpu} memory {size_text(used)} / {size_text(total)}", used / total >= NEAR_LIMIT
    if not latest:
        return "", False
    text = f"memory {size_text(sum(u.memory for u in latest.values()))}"
    return text, node_memory_percent is not None and node_memory_percent >= NEAR_LIMIT * 100


def metrics(latest: dict[int, Usage]) -> dict[str, float]:
    """A sample as MLflow metrics: `system/rank_N/cpu_percent`, `memory_mib`, and on GPUs `gpu_*`."""
    out: dict[str, float] = {}
    for rank, u in sorted(latest.items()):
        key = f"system/rank_{rank}/"
        out[key + "cpu_percent"] = round(u.cpu_percent, 1)
        out[key + "memory_mib"] = round(u.memory / 2**20, 1)
        if u.gpu_percent is not None:
            out[key + "gpu_utilization_percent"] = u.gpu_percent
        if u.gpu_memory is not None:
            out[key + "gpu_memory_mib"] = round(u.gpu_memory / 2**20, 1)
    return out


def peak_metrics(peaks: dict[int, Peak]) -> dict[str, float]:
    """Each rank's peaks as MLflow metrics: `system/rank_N/memory_peak_mib` (and `gpu_memory_peak_mib`)."""
    out: dict[str, float] = {}
    for rank, peak in sorted(peaks.items()):
        out[f"system/rank_{rank}/memory_peak_mib"] = round(peak.memory / 2**20, 1)
        if peak.gpu_memory is not None:
            out[f"system/rank_{rank}/gpu_memory_peak_mib"] = round(peak.gpu_memory / 2**20, 1)
    return out


def rank_gpus(spec: JobSpec, visible: str | None) -> dict[int, str]:
    """rank -> its GPU as NVML can find it (an index or a UUID), from CUDA_VISIBLE_DEVICES and LOCAL_RANK = rank."""
    if not spec.uses_gpu or spec.num_nodes != 1:
        return {}
    ids = None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]
    found: dict[int, str] = {}
    for rank in range(spec.world_size):
        if ids is None:
            found[rank] = str(rank)
        elif rank < len(ids) and (ids[rank].isdigit() or ids[rank].startswith("GPU-")):
            found[rank] = ids[rank]  # a MIG instance or a name NVML cannot look up is left out
    return found


# -- sampling -----------------------------------------------------------------------
class _Nvml:
    """NVML handles of the GPUs the ranks use; absent (`ok` False) without nvidia-ml-py or a driver."""

    def __init__(self, gpus: set[str]) -> None:
        self.handles: dict[str, Any] = {}
        self.ok = False
        if not gpus:
            return
        pynvml = nvml.session()
        if pynvml is None:
            return
        self.nvml = pynvml
        self.ok = True
        for gpu in gpus:
            try:
                if gpu.isdigit():
                    self.handles[gpu] = pynvml.nvmlDeviceGetHandleByIndex(int(gpu))
                else:
                    self.handles[gpu] = pynvml.nvmlDeviceGetHandleByUUID(gpu)
            except pynvml.NVMLError:
                pass

    def read(self, gpu: str) -> tuple[float | None, int, int] | None:
        """(utilization %, memory used, memory total) of one GPU, or None."""
        handle = self.handles.get(gpu)
        if handle is None:
            return None
        try:
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
        except self.nvml.NVMLError:
            return None
        try:
            busy: float | None = float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except self.nvml.NVMLError:
            busy = None
        return busy, int(memory.used), int(memory.total)


class ResourceSampler(Listener):
    """Samples each rank's CPU, memory and GPU while the call runs; read `latest()`, `peaks()`. See the module."""

    def __init__(self, period: float = PERIOD, log_every: float = LOG_EVERY) -> None:
        self.period = period
        self.log_every = log_every
        self.sinks: list[Sink] = []
        self.sink_error: str | None = None
        self.node_memory_percent: float | None = None
        #: Samples taken so far: a reader redraws when it changes.
        self.count = 0
        self._lock = threading.Lock()
        self._latest: dict[int, Usage] = {}
        self._peaks: dict[int, Peak] = {}
        self._trees = TreeUsage()  # each rank's process and its children (launch/tree_usage.py)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: RunContext | None = None
        self._gpus: dict[int, str] = {}
        self._nvml: _Nvml | None = None
        self._pending: dict[str, float] = {}  # each rank's newest figures not yet handed to the sinks

    # -- what readers see ----------------------------------------------------
    def latest(self) -> dict[int, Usage]:
        """The newest sample of each rank whose process is alive."""
        with self._lock:
            return dict(self._latest)

    def peaks(self) -> dict[int, Peak]:
        """Each sampled rank's peak so far."""
        with self._lock:
            return {rank: Peak(p.memory, p.gpu_memory) for rank, p in self._peaks.items()}

    # -- runner hooks --------------------------------------------------------
    def on_start(self, ctx: RunContext) -> None:
        self._ctx = ctx
        visible = ctx.spec.extra_env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._gpus = rank_gpus(ctx.spec, visible) if ctx.spec.num_nodes == 1 else {}
        self._thread = threading.Thread(target=self._loop, name="air_magic-resources", daemon=True)
        self._thread.start()

    def on_end(self, result: JobResult) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._send({**self._pending, **peak_metrics(self.peaks())})
        if self.sink_error is not None:
            warnings.warn(
                f"air_magic: what the ranks used could not be logged to the run ({self.sink_error}); "
                "the call itself is not affected.",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- the sampling thread ---------------------------------------------------
    def _loop(self) -> None:
        self._nvml = _Nvml(set(self._gpus.values()))
        next_log = 0.0
        # Until the first figures, look more often: a call of a second still gets a reading.
        while not self._stop.wait(self.period if self.count and self._peaks else min(self.period, FIRST)):
            try:
                self.sample()
            except Exception:  # noqa: BLE001, S112 - a figure missed now is read again a second later
                continue
            if self._pending and time.monotonic() >= next_log:
                next_log = time.monotonic() + self.log_every
                self._send(self._pending)
                self._pending = {}

    def sample(self) -> None:
        """Read every rank's figures once (the sampling thread calls this every `period` seconds)."""
        assert self._ctx is not None
        pids = dict(self._ctx.pids)
        gpu_reads: dict[str, tuple[float | None, int, int] | None] = {}
        now: dict[int, Usage] = {}
        for rank, pid in pids.items():
            if self._ctx.spec.num_nodes != 1:  # a process of another machine: its node's figures
                found = read_usage(RunDir(self._ctx.run_dir).usage(rank))
                if found is not None:
                    now[rank] = Usage(*found)
                continue
            found = self._trees.sample(pid)
            if found is None:
                continue  # the rank has exited
            cpu, memory = found
            gpu = self._gpus.get(rank)
            read = None
            if gpu is not None and self._nvml is not None and self._nvml.ok:
                if gpu not in gpu_reads:
                    gpu_reads[gpu] = self._nvml.read(gpu)
                read = gpu_reads[gpu]
            if read is None:
                now[rank] = Usage(cpu, memory)
            else:
                now[rank] = Usage(cpu, memory, gpu, read[0], read[1], read[2])
        try:
            node = psutil.virtual_memory().percent
        except (OSError, psutil.Error):
            node = None
        with self._lock:
            self._latest = now
            for rank, usage in now.items():
                self._peaks.setdefault(rank, Peak()).add(usage)
            self.node_memory_percent = node
            self.count += 1
        if now:  # merged: a rank that exited before the next hand-over still has its last figures sent
            self._pending.update(metrics(now))

    def _send(self, values: dict[str, float]) -> None:
        if not values or self._ctx is None or self.sink_error is not None:
            return
        step = int(self._ctx.elapsed)
        for sink in self.sinks:
            try:
                sink(values, step)
            except Exception as exc:  # noqa: BLE001 - reported once at the end; sampling goes on
                self.sink_error = f"{type(exc).__name__}: {exc}"
