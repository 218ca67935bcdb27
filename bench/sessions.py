"""Sessions benchmark: ten training steps per call of a model that takes a while to build and compile, three ways.

A GPT-style decoder from torch alone (no download), built, wrapped in DDP and
`torch.compile`d, then trained 10 steps per call, in one real Jupyter kernel, in
the same run:

- warm: `@distributed` function that builds, compiles and trains every call (ranks forked from the helper);
- hot: the same function with `keep_alive`, so processes, imports and the process group stay, the model not;
- session: a `%%distributed --session` cell builds and compiles once; each later cell trains 10 steps on it.

Each way is called `--repeat` times after its first call; the table gives the median of those calls and the
ratio to the session's. GPUs and nccl (bf16 autocast) when the node has them, else CPU ranks and gloo.

    python bench/sessions.py [--ranks 2] [--repeat 3] [--gpt2] [--no-compile] [--out bench/results/sessions.json]

`--gpt2` uses GPT-2 small's shape (12 layers, d_model 768, 12 heads, seq 512, batch 8, vocab 50257);
the default is a small shape that builds and compiles in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import Kernel

SMALL = {"layers": 4, "d_model": 256, "heads": 4, "seq": 128, "batch": 4, "vocab": 8192}
GPT2 = {"layers": 12, "d_model": 768, "heads": 12, "seq": 512, "batch": 8, "vocab": 50257}

MODEL = """
import os, time, torch, torch.distributed as dist

def build(shape, compile_model):
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if gpu else "gloo")
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(0)

    class Decoder(torch.nn.Module):
        def __init__(self, s):
            super().__init__()
            self.embed = torch.nn.Embedding(s["vocab"], s["d_model"])
            self.pos = torch.nn.Parameter(torch.zeros(s["seq"], s["d_model"]))
            layer = torch.nn.TransformerEncoderLayer(
                s["d_model"], s["heads"], 4 * s["d_model"], dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = torch.nn.TransformerEncoder(layer, s["layers"])
            self.head = torch.nn.Linear(s["d_model"], s["vocab"], bias=False)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(s["seq"]))

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos
            return self.head(self.blocks(x, mask=self.mask, is_causal=True))

    model = torch.nn.parallel.DistributedDataParallel(Decoder(shape).to(device))
    if compile_model:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return model, opt

def train(model, opt, shape, steps=10):
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    for _ in range(steps):
        tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=g).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=gpu):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if gpu:
        torch.cuda.synchronize()
    return loss.item()
"""

FUNCTIONS = """
from air_magic import distributed

def build_and_train(shape, compile_model):
    model, opt = build(shape, compile_model)
    return train(model, opt, shape)

warm = distributed(num_accelerators=RANKS, accelerator_type=TYPE, mlflow=False)(build_and_train)
hot = distributed(num_accelerators=RANKS, accelerator_type=TYPE, mlflow=False, keep_alive=600)(build_and_train)
"""


def gpu_name() -> str:
    """The first GPU's name, from NVML (this process creates no CUDA context)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)))
    finally:
        pynvml.nvmlShutdown()


def timed(kernel: Kernel, code: str) -> float:
    t0 = time.perf_counter()
    kernel.execute(code, timeout=1800).check()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 small's shape instead of the small default")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape = GPT2 if args.gpt2 else SMALL
    compile_model = not args.no_compile
    work = Path(tempfile.mkdtemp(prefix="air_magic-bench-sessions-"))
    (work / "runs").mkdir()
    kernel = Kernel(work, env={"AIR_MAGIC_RUNS_DIR": str(work / "runs"), "AIR_MAGIC_DISPLAY": "text"})
    times: dict[str, list[float]] = {"warm": [], "hot": [], "session": []}
    first: dict[str, float] = {}
    try:
        kernel.execute("%load_ext air_magic\nimport torch").check()
        gpus = int(kernel.value("torch.cuda.device_count()"))
        kind = "GPU" if gpus else "CPU"
        ranks = min(args.ranks, gpus) if gpus else args.ranks
        kernel.execute(f"RANKS, TYPE = {ranks}, {kind!r}\nSHAPE = {shape!r}\nCOMPILE = {compile_model}").check()
        kernel.execute(MODEL).check()
        kernel.execute(FUNCTIONS).check()
        options = f"--gpus {ranks} --accelerator-type {kind} --no-mlflow"
        for way, call in (
            ("warm", "warm.distributed(SHAPE, COMPILE)"),
            ("hot", "hot.distributed(SHAPE, COMPILE)"),
            ("session", f"%%distributed --session bench {options}\ntrain(model, opt, SHAPE)"),
        ):
            if way == "session":
                first[way] = timed(
                    kernel,
                    f"%%distributed --session bench {options}\nmodel, opt = build(SHAPE, COMPILE)\n"
                    "train(model, opt, SHAPE)",
                )
            else:
                first[way] = timed(kernel, call)
            times[way] = [timed(kernel, call) for _ in range(args.repeat)]
            print(f"{way}: first {first[way]:.2f} s, then {', '.join(f'{t:.2f}' for t in times[way])} s", flush=True)
        kernel.execute("%distributed_release").check()
    finally:
        kernel.shutdown()
    median = {way: statistics.median(values) for way, values in times.items()}
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "load_average_1min": os.getloadavg()[0],
        "device": gpu_name() if gpus else "",
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), {ranks} {kind} rank(s)",
        "shape": shape,
        "compile": compile_model,
        "first_call_s": first,
        "calls_s": times,
        "median_s": median,
        "ratio_to_session": {way: median[way] / median["session"] for way in median},
    }
    print(f"\n{'way':10} {'first call':>11} {'median call':>12} {'x session':>10}")
    for way in times:
        ratio = record["ratio_to_session"][way]
        print(f"{way:10} {first[way]:>10.2f}s {median[way]:>11.2f}s {ratio:>9.1f}x")
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
