"""Fault figures: time from fault to return, processes leaked and lines lost, per scenario.

Runs the fault scenarios of tests/test_faults.py (1 to 4 timed) through the
one runner, outside Jupyter, several times each, and writes
bench/results/faults.json. Each rank prints numbered lines before its
fault and starts a `sleep` child; afterwards the script counts lines missing
from the logs and from what the listener received, and any worker or child
still running.

    python bench/faults.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from air_magic import distributed
from air_magic.calls import runner
from air_magic.listeners import Listener
from air_magic.owner import owner

LINES = 200


class Counter(Listener):
    """Keeps every character the runner delivered, per rank; with `cancel`, presses Cancel once rank 1 hangs."""

    def __init__(self, cancel: bool = False) -> None:
        self.text: dict[int, list[str]] = {}
        self.cancel = cancel
        self.cancelled_at: float | None = None

    def on_start(self, ctx) -> None:  # type: ignore[no-untyped-def]
        self.ctx = ctx

    def on_output(self, rank: int, text: str) -> None:
        self.text.setdefault(rank, []).append(text)
        if self.cancel and self.cancelled_at is None and "FAULT_AT" in text:
            self.cancelled_at = time.time()
            self.ctx.cancel()


def job(kind: str, marker: str) -> int:
    """Print LINES numbered lines, start a child, then fail in the way `kind` says (on rank 1)."""
    import os
    import signal
    import subprocess
    import time

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    child = subprocess.Popen(["sleep", marker])
    print(f"PIDS {os.getpid()} {child.pid}", flush=True)
    if kind in ("raise", "hang-collective"):
        dist.init_process_group("gloo")
    for i in range(LINES):
        print(f"rank {rank} line {i}", flush=True)
    if kind == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(0.5)
    if rank == 1:
        print(f"FAULT_AT {time.time()}", flush=True)
        if kind == "raise":
            raise ValueError("rank 1 fails while rank 0 waits in all_reduce")
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "segfault":
            import ctypes

            ctypes.string_at(0)
        if kind == "exit7":
            os._exit(7)
        if kind == "ignore-term":
            raise ValueError("rank 1 fails while rank 0 ignores SIGTERM")
        if kind in ("hang", "hang-collective"):
            time.sleep(3600)
    if kind in ("raise", "hang-collective"):
        dist.all_reduce(torch.ones(1))
    while True:
        time.sleep(0.1)


def fault_at(run_dir: Path) -> float:
    return float(re.findall(r"FAULT_AT ([0-9.]+)", (run_dir / "rank-1.log").read_text())[-1])


def one(kind: str, timeout: float | None) -> dict:
    marker = f"{300 + uuid.uuid4().int % 10**6 / 10**6:.6f}"
    counter = Counter(cancel=kind == "cancel")
    kind = "hang" if kind == "cancel" else kind
    fn = distributed(2, mlflow=False, timeout=timeout)(job)
    spec = fn.settings.spec(job, (kind, marker), {}, f"fault-{kind}")
    result = owner().submit(
        spec, listeners=[counter]
    )  # the one path every call takes; a failed call is in result.error
    returned = time.time()
    error, run_dir = result.error, result.run_dir
    hang = kind in ("hang", "hang-collective")
    if counter.cancelled_at is not None:
        fault = counter.cancelled_at  # the Cancel press
    elif hang:
        fault = returned - result.elapsed + (timeout or 0)  # a hang's fault: the deadline
    else:
        fault = fault_at(run_dir)
    pids = [int(p) for r in (0, 1) for p in re.findall(r"PIDS (\d+) (\d+)", (run_dir / f"rank-{r}.log").read_text())[0]]
    time.sleep(0.5)
    leaked = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    leaked += [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]]
    lost_log = lost_shown = 0
    for r in (0, 1):
        log = (run_dir / f"rank-{r}.log").read_text(errors="replace")
        shown = "".join(counter.text.get(r, []))
        for i in range(LINES):
            line = f"rank {r} line {i}\n"
            lost_log += line not in log
            lost_shown += line not in shown
    return {
        "kind": kind,
        "error": type(error).__name__,
        "first_rank_named": None if hang else "rank 1" in (str(error) + " ".join(getattr(error, "__notes__", []))),
        "fault_to_return_s": round(returned - fault, 3),
        "leaked": len(set(leaked)),
        "lines_lost_from_logs": lost_log,
        "lines_lost_from_display": lost_shown,
    }


SCENARIOS = [
    ("1 rank raises, peer in all_reduce", "raise", 120),
    ("2 rank SIGKILLed", "sigkill", 120),
    ("2 rank segfaults", "segfault", 120),
    ("2 rank calls os._exit(7)", "exit7", 120),
    ("3 rank hangs (sleep), timeout 3 s", "hang", 3),
    ("3 collective never completes, timeout 3 s", "hang-collective", 3),
    ("3 rank hangs, timeout None, Cancel pressed", "cancel", None),
    ("4 peer ignores SIGTERM", "ignore-term", 120),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "faults.json"))
    args = parser.parse_args()
    os.environ.setdefault("AIR_MAGIC_RUNS_DIR", f"/tmp/air_magic-bench-faults-{os.getpid()}")
    one("exit7", 120)  # start the supervisor (it preloads torch) outside the figures
    rows = []
    for title, kind, timeout in SCENARIOS:
        runs = [one(kind, timeout) for _ in range(args.repeat)]
        times = [r["fault_to_return_s"] for r in runs]
        row = {
            "scenario": title,
            "runs": len(runs),
            "errors": sorted({r["error"] for r in runs}),
            "rank_named": None if runs[0]["first_rank_named"] is None else all(r["first_rank_named"] for r in runs),
            "fault_to_return_s": {"median": statistics.median(times), "max": max(times), "min": min(times)},
            "processes_leaked": sum(r["leaked"] for r in runs),
            "lines_lost": sum(r["lines_lost_from_logs"] + r["lines_lost_from_display"] for r in runs),
        }
        rows.append(row)
        print(
            f"{title:45s} {row['errors']} rank named {row['rank_named']}; fault->return median "
            f"{row['fault_to_return_s']['median']:.2f} s (max {row['fault_to_return_s']['max']:.2f}); "
            f"leaked {row['processes_leaked']}; lines lost {row['lines_lost']} of {2 * LINES * len(runs)} (x2 places)",
            flush=True,
        )
    report = {
        "machine": f"{os.cpu_count()}-core CPU, {platform.platform()}",
        "python": platform.python_version(),
        "stop_grace_s": runner.STOP_GRACE,
        "date": time.strftime("%Y-%m-%d"),
        "scenarios": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
