"""The resource sampler's words, peaks, metric names and GPU choice, and its sampling of a real child process."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from air_magic.display.record import record_bundle
from air_magic.display.tail import TailBuffer
from air_magic.job import JobResult, JobSpec, RankResult, RankState
from air_magic.launch.files.rank_files import write_usage
from air_magic.launch.files.rundir import RunDir
from air_magic.listeners import RunContext
from air_magic.resources import (
    Peak,
    ResourceSampler,
    Usage,
    header_text,
    metrics,
    peak_metrics,
    peak_text,
    rank_gpus,
    size_text,
    usage_text,
)

MiB, GiB = 2**20, 2**30


def spec(world: int = 2, accelerator: str = "CPU", nodes: int = 1, **env: str) -> JobSpec:
    return JobSpec(print, (), {}, "train", world, accelerator, None, mlflow=False, extra_env=env, num_nodes=nodes)


def test_sizes_and_usage_read_as_people_write_them():
    """Bytes read as MiB below 1 GiB, GiB above; a usage line names CPU, memory, and the GPU when there is one."""
    assert size_text(412 * MiB) == "412 MiB" and size_text(int(1.28 * GiB)) == "1.28 GiB"
    assert size_text(int(61.2 * GiB)) == "61.2 GiB"
    assert usage_text(Usage(97.6, 412 * MiB)) == "CPU 98% · memory 412 MiB"
    gpu = Usage(101.0, 2 * GiB, "3", 87.0, int(61.2 * GiB), 80 * GiB)
    assert usage_text(gpu) == "CPU 101% · memory 2.00 GiB · GPU 3: 87% · 61.2 GiB / 80.0 GiB"


def test_a_peak_keeps_the_most_each_figure_reached():
    """Peak memory and GPU memory are each the highest seen, whatever order the samples came in."""
    peak = Peak()
    for usage in (Usage(0, 300 * MiB), Usage(0, 412 * MiB, "0", 1, 50 * GiB, 80 * GiB), Usage(0, 100 * MiB)):
        peak.add(usage)
    assert (peak.memory, peak.gpu_memory) == (412 * MiB, 50 * GiB)
    assert peak_text(peak) == "peak memory 412 MiB · GPU memory peak 50.0 GiB"
    assert peak_text(Peak(412 * MiB)) == "peak memory 412 MiB"


def test_metrics_are_named_per_rank_in_mib():
    """A sample becomes system/rank_N/... metrics; GPU figures only where a GPU was read."""
    sample = {0: Usage(50.0, 412 * MiB, "0", 87.0, 1024 * MiB, 80 * GiB), 1: Usage(12.34, 100 * MiB)}
    assert metrics(sample) == {
        "system/rank_0/cpu_percent": 50.0,
        "system/rank_0/memory_mib": 412.0,
        "system/rank_0/gpu_utilization_percent": 87.0,
        "system/rank_0/gpu_memory_mib": 1024.0,
        "system/rank_1/cpu_percent": 12.3,
        "system/rank_1/memory_mib": 100.0,
    }
    assert peak_metrics({0: Peak(412 * MiB, 2 * GiB), 1: Peak(MiB)}) == {
        "system/rank_0/memory_peak_mib": 412.0,
        "system/rank_0/gpu_memory_peak_mib": 2048.0,
        "system/rank_1/memory_peak_mib": 1.0,
    }


def test_each_rank_s_gpu_is_its_entry_of_cuda_visible_devices():
    """Rank r uses GPU r, or the r-th visible device (index or UUID); MIG instances, CPU and multi-node calls get
    none."""
    assert rank_gpus(spec(2, "GPU_2xH100"), None) == {0: "0", 1: "1"}
    assert rank_gpus(spec(2, "GPU_2xH100"), "6,7") == {0: "6", 1: "7"}
    assert rank_gpus(spec(2, "GPU_2xH100"), "GPU-abc, MIG-def") == {0: "GPU-abc"}
    assert rank_gpus(spec(2, "CPU"), None) == {}
    assert rank_gpus(spec(4, "GPU_2xH100", nodes=2), None) == {}


def test_the_header_shows_the_fullest_gpu_or_the_ranks_memory_and_warns_near_the_limit():
    """The GPU with the fullest memory is named and flagged at 90 %; without GPUs, the ranks' memory together,
    flagged when the node's memory is 90 % used."""
    roomy = Usage(0, MiB, "0", 10.0, 40 * GiB, 80 * GiB)
    full = Usage(0, MiB, "1", 99.0, 75 * GiB, 80 * GiB)
    assert header_text({0: roomy, 1: full}, None) == ("GPU 1 memory 75.0 GiB / 80.0 GiB", True)
    assert header_text({0: roomy}, None) == ("GPU 0 memory 40.0 GiB / 80.0 GiB", False)
    cpu = {0: Usage(0, 300 * MiB), 1: Usage(0, 200 * MiB)}
    assert header_text(cpu, 50.0) == ("memory 500 MiB", False)
    assert header_text(cpu, 95.0) == ("memory 500 MiB", True)
    assert header_text({}, 95.0) == ("", False)


def test_the_record_names_each_rank_s_peak(tmp_path: Path):
    """With peaks, each rank's line in the record reads 'rank 0: done · peak memory 412 MiB', in HTML and text."""
    result = JobResult(spec(), tmp_path, [RankResult(0, RankState.DONE), RankResult(1, RankState.FAILED)])
    peaks = {0: Peak(412 * MiB), 1: Peak(100 * MiB, int(61.2 * GiB))}
    bundle = record_bundle(
        result, [TailBuffer(), TailBuffer()], [tmp_path / "0.log", tmp_path / "1.log"], None, peaks=peaks
    )
    for kind in ("text/html", "text/plain"):
        assert "rank 0: done · peak memory 412 MiB" in bundle[kind]
        assert "rank 1: failed · peak memory 100 MiB · GPU memory peak 61.2 GiB" in bundle[kind]
    plain = record_bundle(result, [TailBuffer(), TailBuffer()], [tmp_path / "0.log", tmp_path / "1.log"], None)
    assert "peak" not in plain["text/plain"] and "rank 0: done" in plain["text/plain"]


def test_a_multi_node_call_shows_what_each_node_sampled_and_never_reads_a_local_pid(tmp_path: Path):
    """Ranks on other machines: their pids are not read here (this process's pid stands in and shows nothing);
    a rank's figures are those its node sent last (its usage file), and a rank with none shows none."""
    ctx = RunContext(spec(4, nodes=2), tmp_path, [])
    ctx.pids.update({0: os.getpid(), 1: os.getpid()})
    write_usage(RunDir(tmp_path).usage(1), (150.0, 3 * GiB))
    sampler = ResourceSampler(period=0.05)
    sampler.on_start(ctx)
    deadline = time.monotonic() + 10
    while 1 not in sampler.latest() and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.on_end(JobResult(ctx.spec, tmp_path, []))
    assert sampler.latest() == {1: Usage(150.0, 3 * GiB)}
    assert sampler.peaks()[1].memory == 3 * GiB and 0 not in sampler.peaks()


class FakeNvml:
    """Stands in for nvidia-ml-py where no GPU exists: two 80 GiB devices, by index and by UUID."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.used = {"dev0": 10 * GiB, "dev1": 70 * GiB}
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"dev{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid != "GPU-one":
            raise self.NVMLError(uuid)
        return "dev1"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> object:
        return type("Memory", (), {"used": self.used[handle], "total": 80 * GiB})()

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> object:
        return type("Rates", (), {"gpu": 87 if handle == "dev1" else 3})()


def test_each_rank_reads_its_own_gpu_through_nvml(tmp_path: Path, monkeypatch):
    """With NVML (a stand-in here; the GPU tests run the real one, started once per process), rank 0 reads GPU 0 by
    index and rank 1 its
    UUID's device; their memory, utilization and peaks reach the sample, the metrics and the record's words."""
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr("air_magic.launch.nvml._state", [])  # this process's NVML session, not started yet
    ctx = RunContext(spec(2, "GPU_2xH100", CUDA_VISIBLE_DEVICES="0,GPU-one"), tmp_path, [])
    ctx.pids.update({0: os.getpid(), 1: os.getpid()})
    sampler = ResourceSampler(period=0.05)
    sampler.on_start(ctx)
    deadline = time.monotonic() + 10
    while len(sampler.latest()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    nvml.used["dev1"] = 20 * GiB  # lower than before: the peak keeps the 70 GiB
    seen = sampler.count
    while sampler.count < seen + 2:
        time.sleep(0.02)
    sampler.on_end(JobResult(ctx.spec, tmp_path, []))
    latest = sampler.latest()
    assert (latest[0].gpu, latest[0].gpu_percent, latest[0].gpu_memory) == ("0", 3.0, 10 * GiB)
    assert (latest[1].gpu, latest[1].gpu_percent, latest[1].gpu_memory) == ("GPU-one", 87.0, 20 * GiB)
    assert peak_text(sampler.peaks()[1]).endswith("GPU memory peak 70.0 GiB")
    assert metrics(latest)["system/rank_1/gpu_memory_mib"] == 20 * 1024
    assert nvml.calls == ["init"]
    again = ResourceSampler(period=0.05)  # the next call (a hot call: hundredths of a second) neither starts
    again.on_start(RunContext(ctx.spec, tmp_path, []))  # nor shuts NVML down again
    again.on_end(JobResult(ctx.spec, tmp_path, []))
    assert nvml.calls == ["init"]
