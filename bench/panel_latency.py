"""Benchmark of the live panel in a real browser (JupyterLab in headless Chromium).

Measures:
  1. latency from a worker's print to the line appearing in the panel's DOM
     (2 ranks, a timestamped line every 50 ms each; median and 95th percentile);
  2. the kernel's CPU use while 2 ranks print 10 MB/s each, and how long the
     page takes to answer a script call meanwhile (is the browser still responsive).

Run: python bench/panel_latency.py [--seconds 15]   (needs /usr/bin/chromium, jupyterlab, playwright)
Writes bench/results/panel.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from lab import Lab, Notebook, browser_page, write_notebook  # noqa: E402

LINES = 200

CELLS = [
    "from air_magic import distributed",
    f"""@distributed(num_accelerators=2, accelerator_type="CPU")
def ticker():
    import os, time
    r = os.environ["RANK"]
    for i in range({LINES}):
        print(f"LAT {{r}} {{i}} {{time.time():.6f}}", flush=True)
        time.sleep(0.05)
ticker.distributed()""",
    """@distributed(num_accelerators=2, accelerator_type="CPU")
def flood(seconds, rate=10 * 1024 * 1024):
    import os, sys, time
    line = f"rank {os.environ['RANK']} " + "x" * 90 + "\\n"
    block = line * (rate // 10 // len(line))
    start = time.monotonic()
    tick = 0
    while time.monotonic() - start < seconds:
        sys.stdout.write(block)
        sys.stdout.flush()
        tick += 1
        time.sleep(max(0.0, start + tick * 0.1 - time.monotonic()))
    return tick * len(block)
flood.distributed(SECONDS)""",
]

OBSERVER = r"""
() => {
  window.__lat = []; const seen = new Set();
  const scan = () => {
    const now = Date.now() / 1000;
    for (const el of document.querySelectorAll('.air-magic-log')) {
      for (const m of (el.textContent || '').matchAll(/LAT (\d+) (\d+) ([\d.]+)/g)) {
        const key = m[1] + ':' + m[2];
        if (!seen.has(key)) { seen.add(key); window.__lat.push(now - parseFloat(m[3])); }
      }
    }
  };
  new MutationObserver(scan).observe(document.body, {subtree: true, childList: true, characterData: true});
}
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of the 2 x 10 MB/s flood")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="air-magic-bench-"))
    (root / "runs").mkdir()
    cells = CELLS[:2] + [CELLS[2].replace("SECONDS", str(args.seconds))]
    write_notebook(root / "bench.ipynb", cells)
    lab = Lab(root, env={"AIR_MAGIC_RUNS_DIR": str(root / "runs"), "AIR_MAGIC_DISPLAY": "auto"})
    try:
        with browser_page() as page:
            nb = Notebook(page, lab, "bench.ipynb")
            nb.run(0)
            nb.wait_done(0)
            page.evaluate(OBSERVER)
            nb.run(1)
            nb.wait_done(1, timeout=300)
            time.sleep(0.5)
            lat = page.evaluate("window.__lat")
            (kernel_pid,) = lab.kernel_pids()
            kernel = psutil.Process(kernel_pid)
            nb.run(2)
            page.locator(".air-magic-log[data-rank='0']").nth(1).wait_for(state="attached", timeout=60_000)
            before_cpu, before_wall = sum(kernel.cpu_times()[:2]), time.monotonic()
            answers = []
            while True:
                t0 = time.monotonic()
                page.evaluate("1")
                answers.append(time.monotonic() - t0)
                prompt = nb.cell(2).locator(".jp-InputPrompt").inner_text()
                if "*" not in prompt and prompt.strip() != "[ ]:":
                    break
                time.sleep(0.25)
            wall = time.monotonic() - before_wall
            cpu = (sum(kernel.cpu_times()[:2]) - before_cpu) / wall
            written = [int(n) for n in re.findall(r"\d+", nb.cell(2).locator(".jp-OutputArea-output").last.inner_text())]
            nb.screenshot("bench-flood.png")
    finally:
        lab.close()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{psutil.cpu_count()}-core CPU VM, {platform.python_version()}",
        "latency_lines": len(lat),
        "latency_expected": 2 * LINES,
        "latency_median_ms": round(1000 * statistics.median(lat), 1),
        "latency_p95_ms": round(1000 * percentile(lat, 0.95), 1),
        "latency_max_ms": round(1000 * max(lat), 1),
        "flood_rate_mb_s_per_rank": 10,
        "flood_seconds": args.seconds,
        "flood_mb_written_per_rank": [round(n / 1e6, 1) for n in written],
        "flood_measured_wall_s": round(wall, 1),
        "kernel_cpu_percent_during_flood": round(100 * cpu, 1),
        "page_answer_median_ms": round(1000 * statistics.median(answers), 1),
        "page_answer_max_ms": round(1000 * max(answers), 1),
    }
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "panel.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
