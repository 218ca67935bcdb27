"""Time a %%distributed cell against the same work through @distributed, in a real Jupyter kernel.

    python bench/cell_magic.py [--repeat 5] [--gpus 2]

Prints the median wall time of each, measured from sending the cell to its reply.
Not a test: the numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "trivial": "import os\nint(os.environ['RANK'])",
    "gloo all-reduce": (
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "t.item()"
    ),
}


def timed(kc, code: str) -> float:
    t0 = time.perf_counter()
    reply = kc.execute_interactive(code, timeout=300, output_hook=lambda msg: None)
    took = time.perf_counter() - t0
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"cell failed: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gpus", type=int, default=2)
    args = parser.parse_args()
    runs = tempfile.mkdtemp(prefix="air_magic-bench-")
    env = dict(os.environ, AIR_MAGIC_RUNS_DIR=runs, PYTHONPATH=str(ROOT))
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env, extra_arguments=["--HistoryManager.enabled=False"])
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        timed(kc, "%load_ext air_magic\nfrom air_magic import distributed")
        timed(kc, f"%%distributed --gpus {args.gpus} --no-mlflow\n1")  # starts the supervisor once
        print(f"{args.gpus} ranks, median of {args.repeat}, Python {sys.version.split()[0]}")
        for name, body in CASES.items():
            indented = "\n".join("    " + line for line in body.splitlines()[:-1] + ["return " + body.splitlines()[-1]])
            timed(kc, f"@distributed({args.gpus}, mlflow=False)\ndef work():\n{indented}")
            magic = [timed(kc, f"%%distributed --gpus {args.gpus} --no-mlflow\n{body}") for _ in range(args.repeat)]
            deco = [timed(kc, "work.distributed()") for _ in range(args.repeat)]
            print(
                f"{name:16s} %%distributed {statistics.median(magic):6.2f} s   @distributed "
                f"{statistics.median(deco):6.2f} s"
            )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


if __name__ == "__main__":
    main()
