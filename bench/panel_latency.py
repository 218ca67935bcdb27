"""Benchmark of the live panel in a real browser (JupyterLab in headless Chromium).

Measures:
  0. time from Shift+Enter to the panel on screen (with its "starting" line), for the
     first call of a fresh kernel (MLflow on, its default store, nothing imported
     yet) and for a later call; and to the first line of a rank;
  1. latency from a worker's print to the line appearing in the panel's DOM
     (2 ranks, a timestamped line every 50 ms each; median and 95th percentile),
     and from a worker's `mlflow.log_metric` to its point in the panel's chart;
  2. the kernel's CPU use while 2 ranks print 10 MB/s each, and how long the
     page takes to answer a script call meanwhile (is the browser still responsive).

Run: python bench/panel_latency.py [--seconds 15]   (needs /usr/bin/chromium, jupyterlab, playwright)
Writes bench/results/panel.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
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

from browser import Notebook, browser_page
from lab import Lab, write_notebook

LINES = 200

CELLS = [
    "from air_magic import distributed",
    f"""@distributed(num_accelerators=2, accelerator_type="CPU")
def ticker():
    import os, time, mlflow
    r = os.environ["RANK"]
    for i in range({LINES}):
        print(f"LAT {{r}} {{i}} {{time.time():.6f}}", flush=True)
        mlflow.log_metric("clock", time.time() % 100, step=i)
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
    """@distributed(num_accelerators=2, accelerator_type="CPU")
def quick():
    print("quick", flush=True)
quick.distributed()""",
]

#: For the cell run next (window.__watch_idx): ms from its Shift+Enter to the first air_magic output in it
#: (the starting line, the panel or the record) and to the first line of a rank, appended to window.__times.
APPEARANCE = r"""
() => {
  window.__watch = null; window.__times = []; window.__watch_idx = null;
  const SHOWN = '.air-magic-starting, .air-magic-panel, .air-magic-record';
  const LINES = '.air-magic-log, .air-magic-record-log';
  document.addEventListener('keydown', e => {
    if (!(e.key === 'Enter' && e.shiftKey) || window.__watch_idx == null) return;
    const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[window.__watch_idx];
    cell.querySelectorAll(SHOWN + ', ' + LINES).forEach(el => { el.dataset.old = '1'; });
    window.__watch = {cell, t0: performance.now(), shown: null, line: null};
  }, true);
  new MutationObserver(() => {
    const w = window.__watch;
    if (!w) return;
    const now = performance.now(), fresh = sel => [...w.cell.querySelectorAll(sel)].filter(el => !el.dataset.old);
    if (w.shown == null && fresh(SHOWN).length) w.shown = now - w.t0;
    if (w.line == null && fresh(LINES).some(el => /LAT|quick/.test(el.textContent || ''))) w.line = now - w.t0;
    if (w.shown != null && w.line != null) { window.__times.push([w.shown, w.line]); window.__watch = null; }
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}
"""

#: Lag from a rank's log_metric (its LAT line carries the time) to that step in the chart.
CHART_LAG = r"""
() => {
  // rank 0 logs the wall clock (mod 100 s) as its metric; the chart's legend shows its last value
  window.__chart_lag = []; let last = null;
  new MutationObserver(() => {
    const chart = document.querySelector('.air-magic-panel .air-magic-chart[title="clock"]');
    const m = chart && (chart.textContent || '').match(/rank 0: ([\d.]+)/);
    if (m && m[1] !== last) {
      last = m[1];
      window.__chart_lag.push(((Date.now() / 1000) % 100 - parseFloat(m[1]) + 100) % 100);
    }
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}
"""

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
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of the 2 x 10 MB/s flood")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="air-magic-bench-"))
    (root / "runs").mkdir()
    cells = CELLS[:2] + [CELLS[2].replace("SECONDS", str(args.seconds))] + CELLS[3:]
    write_notebook(root / "bench.ipynb", cells)
    lab = Lab(root, env={"AIR_MAGIC_RUNS_DIR": str(root / "runs"), "AIR_MAGIC_DISPLAY": "auto"})
    try:
        with browser_page() as page:
            nb = Notebook(page, lab, "bench.ipynb")
            nb.run(0)
            nb.wait_done(0)
            page.evaluate(OBSERVER)
            page.evaluate(CHART_LAG)
            page.evaluate(APPEARANCE)
            page.evaluate("() => { window.__watch_idx = 1; }")
            nb.run(1)
            nb.wait_done(1, timeout=300)
            time.sleep(0.5)
            lat = page.evaluate("window.__lat")
            chart_lag = page.evaluate("window.__chart_lag")
            page.evaluate("() => { window.__watch_idx = 3; }")
            for _ in range(3):  # later calls
                nb.run(3)
                nb.wait_done(3)
            times = page.evaluate("window.__times")
            appear_first, later = times[0], times[1:]
            warm = [t[0] for t in later]
            warm_lines = [t[1] for t in later]
            print("shown (ms): first call", round(appear_first[0]), "later", warm, flush=True)
            (kernel_pid,) = lab.kernel_pids()
            kernel = psutil.Process(kernel_pid)
            nb.run(2)
            nb.cell(2).locator(".air-magic-log[data-rank='0']").wait_for(state="attached", timeout=60_000)
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
            written = [
                int(n) for n in re.findall(r"\d+", nb.cell(2).locator(".jp-OutputArea-output").last.inner_text())
            ]
            nb.screenshot("bench-flood.png")
    finally:
        lab.close()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{psutil.cpu_count()}-core CPU VM, {platform.python_version()}",
        "load_average_1min": round(os.getloadavg()[0], 1),
        "panel_shown_first_call_ms": round(appear_first[0], 1),
        "first_line_first_call_ms": round(appear_first[1], 1),
        "panel_shown_later_calls_ms": [round(x, 1) for x in warm],
        "first_line_later_calls_ms": [round(x, 1) for x in warm_lines],
        "chart_lag_points": len(chart_lag),
        "chart_lag_median_ms": round(1000 * statistics.median(chart_lag), 1) if chart_lag else None,
        "chart_lag_max_ms": round(1000 * max(chart_lag), 1) if chart_lag else None,
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
