"""What the resource sampler reads on this machine, and what one sample costs, without Jupyter or MLflow.

    python bench/resources.py [--gpu] [--gib 4] [--seconds 4]

Runs one call on every GPU (--gpu; else 2 CPU ranks) whose ranks each hold
--gib GiB (on their GPU with --gpu, in host memory without) for --seconds,
through the runner with the plain-text display and the resource sampler.
Prints the usage lines seen while it ran, each rank's peak as the record words
it, the metrics handed to MLflow's sink, the time one sample takes, the call's
time with and without the sampler, and whether this process initialized CUDA
(it must not).
Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from air_magic import accelerators
from air_magic.display.text import TextDisplay
from air_magic.job import JobSpec
from air_magic.listeners import Listener
from air_magic.owner import owner
from air_magic.resources import ResourceSampler, peak_text, usage_text


def holds(gib: float, seconds: float, gpu: bool) -> int:
    import os
    import time

    rank = int(os.environ["RANK"])
    if gpu:
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        block = torch.ones(int(gib * 2**28), device="cuda")
    else:
        block = bytearray(int(gib * 2**30))
        for i in range(0, len(block), 4096):
            block[i] = 1
    time.sleep(seconds)
    del block
    return rank


class TimedSampler(ResourceSampler):
    """The sampler, timing each sample it takes."""

    costs: list[float]

    def sample(self) -> None:
        started = time.perf_counter()
        super().sample()
        if self.latest():
            self.costs = getattr(self, "costs", []) + [time.perf_counter() - started]


class Watch(Listener):
    """Prints the sampler's usage lines whenever it takes a new sample."""

    def __init__(self, sampler: ResourceSampler) -> None:
        self.sampler = sampler
        self.seen = -1

    def poll(self) -> None:
        if self.sampler.count != self.seen:
            self.seen = self.sampler.count
            for rank, usage in sorted(self.sampler.latest().items()):
                print(f"  sample {self.seen} rank {rank}: {usage_text(usage)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    os.environ.setdefault("AIR_MAGIC_DISPLAY", "text")
    if args.gpu:
        world, kind = accelerators.resolve(None, None)
    else:
        world, kind = 2, "CPU"
    spec = JobSpec(holds, (args.gib, args.seconds, args.gpu), {}, "holds", world, kind, 300, mlflow=False)
    owner().submit(spec, listeners=[TextDisplay()]).raise_for_status()  # the first call starts the helper: not timed
    times: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(2):
        times["without"].append(owner().submit(spec, listeners=[TextDisplay()]).raise_for_status().elapsed)
        sampler = TimedSampler()
        logged: list[dict[str, float]] = []
        sampler.sinks.append(lambda values, step, logged=logged: logged.append(values))
        times["with"].append(
            owner().submit(spec, listeners=[sampler, Watch(sampler), TextDisplay()]).raise_for_status().elapsed
        )
    for rank, peak in sorted(sampler.peaks().items()):
        print(f"rank {rank}: done · {peak_text(peak)}")
    print("metrics handed to MLflow:", len(logged), "batches; last:", logged[-1] if logged else None)
    print(
        f"one sample of {world} live rank(s): median {statistics.median(sampler.costs) * 1000:.2f} ms, "
        f"max {max(sampler.costs) * 1000:.2f} ms over {len(sampler.costs)}"
    )
    print(
        "call time (s) with the sampler:",
        [f"{t:.2f}" for t in times["with"]],
        "without:",
        [f"{t:.2f}" for t in times["without"]],
    )
    torch = sys.modules.get("torch")
    print("this process initialized CUDA:", bool(torch is not None and torch.cuda.is_initialized()))


if __name__ == "__main__":
    main()
