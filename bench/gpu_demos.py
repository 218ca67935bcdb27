"""Execute every demo notebook on this node's GPUs and print how long a training step took.

    python bench/gpu_demos.py [--out results.json] [notebook ...]

Meant for a GPU node (the demos then pick NCCL and one rank per GPU); on a
machine without GPUs it runs them on 2 CPU ranks with gloo, as the tests do.
Each notebook runs headless through demo_notebooks/run.py in a fresh kernel
and a private directory; a cell appended here reads the per-rank median step
time each demo returns (`step_time_s`). A demo that returns none (the sessions,
restarts and data-resume demos) is reported as "ran, no step times"; only a
failing cell counts as a failure. This is a benchmark, not a test: it asserts
nothing about speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMOS = ROOT / "demo_notebooks"
MARK = "STEP-TIMES:"

# Appended to each notebook: per-rank median step times from `results`, whichever shape it has
# (a list indexed by rank, or the DeepSpeed demo's {zero_stage: list}); {} from a demo that times no steps.
PROBE = f"""
import json as _json
try:
    _r = results
    _groups = {{f"ZeRO-{{k}}": v for k, v in _r.items()}} if isinstance(_r, dict) else {{"": _r}}
    _times = {{g: [x["step_time_s"] for x in v] for g, v in _groups.items()}}
except (NameError, KeyError, TypeError, AttributeError):  # no `results`, or results without step times
    _times = {{}}
print({MARK!r} + _json.dumps(_times))
"""


def _load_run_py():
    spec = importlib.util.spec_from_file_location("demo_run", DEMOS / "run.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["demo_run"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def gpu_names() -> list[str]:
    """GPU names through NVML (no CUDA context in this process)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver or no nvidia-ml-py: a CPU machine
        return []
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else name)
        return names
    finally:
        pynvml.nvmlShutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook in demo_notebooks/")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    demo_run = _load_run_py()
    notebooks = args.notebooks or sorted(DEMOS.glob("*.ipynb"))
    gpus = gpu_names()
    import torch

    machine = f"{len(gpus)}x {gpus[0]}" if gpus else f"CPU ({platform.processor() or platform.machine()})"
    print(f"{time.strftime('%Y-%m-%d')}  {machine}  torch {torch.__version__}  Python {platform.python_version()}")
    rows = []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="air_magic-gpu-demos-") as tmp:
        for path in notebooks:
            work = Path(tmp) / path.stem
            (work / "runs").mkdir(parents=True)
            env = {"AIR_MAGIC_RUNS_DIR": str(work / "runs"), "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db"}
            run = demo_run.execute(path, workdir=work, output=work / path.name, timeout=1200, env=env, append=[PROBE])
            text = demo_run.stream_text(run.notebook)
            where = sorted(set(re.findall(r"on (\d+ rank\(s\), \S+);", text)))
            row = {"notebook": path.name, "wall_s": round(run.elapsed, 1), "ranks": where, "error": run.error}
            found = [ln for ln in text.splitlines() if ln.startswith(MARK)]
            if run.error or not found:
                failed += 1
                row["error"] = run.error or "no step times printed"
                print(f"{path.name}: FAILED after {run.elapsed:.1f} s\n{row['error']}\n{text[-4000:]}")
            else:
                row["step_time_ms"] = {
                    group: [round(1000 * t, 2) for t in times]
                    for group, times in json.loads(found[-1][len(MARK) :]).items()
                }
                if not row["step_time_ms"]:
                    print(
                        f"{path.stem:28s} {'; '.join(where):28s} ran, no step times   notebook wall {run.elapsed:.1f} s"
                    )
                for group, times in row["step_time_ms"].items():
                    label = f"{path.stem} {group}".strip()
                    per_rank = ", ".join(f"{t:.2f}" for t in times)
                    print(
                        f"{label:28s} {'; '.join(where):28s} median step per rank (ms): {per_rank}   "
                        f"notebook wall {run.elapsed:.1f} s"
                    )
            rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine, "torch": torch.__version__, "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
