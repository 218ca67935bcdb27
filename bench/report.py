"""Write bench/README.md: each benchmark script, how to run it, and one table per topic from bench/results/.

    python bench/report.py            # rewrite bench/README.md
    python bench/report.py --check    # exit 1 if bench/README.md is not what this script writes

Every figure comes from a file in bench/results/; each table names the file, the machine and the date
as the file records them ("not recorded" where it does not). The scripts' descriptions and command
lines come from their docstrings. tests/unit/test_bench_report.py checks that the README is current.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
README = BENCH / "README.md"
NOT_RECORDED = "not recorded"

Json = dict[str, Any]


# --- reading the results --------------------------------------------------------------------------------------------


def load(name: str) -> Json:
    return dict(json.loads((RESULTS / name).read_text()))


def matching(pattern: str) -> list[str]:
    """Result files whose names match a glob, sorted."""
    return sorted(p.name for p in RESULTS.glob(pattern))


def date_of(d: Json) -> str:
    return str(d.get("date") or NOT_RECORDED)


def tag_of(name: str) -> str:
    """The machine tag some file names carry: launch-2xH200.json -> '2xH200'."""
    match = re.search(r"-(\d+xH\d+)", name)
    return match.group(1) if match else ""


def machine_of(d: Json, name: str) -> str:
    """The machine as the file records it; else the tag of its name, said to come from there."""
    parts = [str(d[k]) for k in ("machine", "device", "host") if d.get(k)]
    if not parts and d.get("cpu_count"):
        parts.append(f"{d['cpu_count']} CPU cores")
    if parts:
        return ", ".join(parts)
    tag = tag_of(name)
    return f"{tag} (from the file name; {NOT_RECORDED} in the file)" if tag else NOT_RECORDED


def load_of(d: Json) -> str:
    """The load average the run recorded, if it did."""
    for key in ("load_average_1min", "load_before"):
        if isinstance(d.get(key), (int, float)):
            return f"{d[key]:.1f}"
    for key in ("load_average", "load_average_at_end"):
        if isinstance(d.get(key), list) and d[key]:
            return f"{d[key][0]:.1f}"
    return NOT_RECORDED


# --- formatting -----------------------------------------------------------------------------------------------------


def s(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f} s"


def ms(x: float | None) -> str:
    return "–" if x is None else f"{x:g} ms"


def table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


#: What a result file cannot say about itself, shown under the tables that use it.
NOTES = {
    "sessions-cpu-one-door-before.json": (
        "the code before one owner object with one door (58c659c), run between `sessions-cpu-one-door-after.json` "
        "and `sessions-cpu-one-door-after-again.json` (the code with it, 9124f39) on a quiet 2-core machine in one "
        "session (load under 4), 1 rank, 3 repeats, no torch.compile: median call warm 3.31 s / 3.62 s after against "
        "3.34 s before, hot 1.75 s / 1.72 s against 1.73 s, session 1.62 s / 1.74 s against 1.73 s; first calls "
        "4.92 s / 4.63 s against 4.61 s (warm). No slowdown beyond the spread of the two after-runs."
    ),
    "call_patterns-cpu-one-door-before.json": (
        "the same before (58c659c) between `call_patterns-cpu-one-door-after.json` and "
        "`call_patterns-cpu-one-door-after-again.json` (9124f39), 2 CPU ranks, quiet machine: Run All's first call "
        "4.74 s / 4.63 s after against 4.21 s before (0.48 / 0.53 of its torchrun yardstick, against 0.49); after a "
        "pause 0.42 s / 0.39 s against 0.44 s; a sweep's calls 2-5 that log 0.21 s / 0.19 s against 0.26 s; hot "
        "calls 2-5 that log 0.069 s / 0.082 s against 0.083 s. Run All's first call is 0.4-0.5 s later in both "
        "after-runs, the yardstick's ratio unchanged; the rest no slower."
    ),
    "launch-cpu-one-door-before.json": (
        "the code before one owner object with one door (58c659c), run between `launch-cpu-one-door-after.json` and "
        "`launch-cpu-one-door-after-again.json` (the code with it) on the 2-core machine in one session, 3 repeats "
        "each, while other jobs loaded both cores (load 6-13): warm 0.134 s / 0.149 s after against 0.262 s "
        "before; hot 0.119 s / 0.159 s against 0.135 s; first call 6.4 s / 3.7 s against 5.8 s. The load's spread "
        "is larger than any difference: no slowdown seen, none shown to be absent within 30 %. The GPU machine could "
        "not be started that session, so no GPU before/after exists for this change."
    ),
    "launch-1xH100-calls-before.json": "the code before one table of calls, the watch, the command line and "
    "machine-wide leases; `launch-1xH100-calls-after.json` is the code with them, measured in the same run on the "
    "same H100 (3 repeats each: differences under about 10 % are within the runs' spread).",
    "sessions-1xH100-calls-before.json": (
        "the code before one table of calls, the watch, the command line, machine-wide leases and the owner's "
        "folder (abe6809), run between `sessions-1xH100-calls-after.json` and `sessions-1xH100-calls-after-again.json` "
        "(the code with them) on the same H100 in one session: after 0.167 s / 0.163 s per session call against "
        "0.183 s before, hot 3.86 s / 3.42 s against 4.88 s, warm 25.3 s / 25.6 s against 26.0 s: no slowdown."
    ),
    "call_patterns-1xH100-calls-before-after.txt": (
        "the same before/after/after-again run of `call_patterns.py --ranks 1` on that H100 (medians of calls 2-5): "
        "warm 1.557 s / 1.510 s against 1.540 s before; a sweep's bare call 1.481 s / 1.486 s against 1.457 s; a hot "
        "call logging to MLflow 0.081 s / 0.098 s against 0.088 s; a bare hot call 0.068 s / 0.059 s against "
        "0.051 s: 8-17 ms more per bare hot call, the only pattern slower by more than its spread."
    ),
    "launch-1xH100-owner-before.json": (
        "the code before one owner of the kernel's calls and kept worlds (abe6809), run between "
        "`launch-1xH100-owner-after.json` and `launch-1xH100-owner-after-again.json` (the code with it) on one H100 in "
        "one session, 3 repeats each: warm 0.988 s / 1.001 s after against 0.982 s before; hot 0.102 s / 0.074 s "
        "against 0.075 s; a hot call logging to MLflow 0.061 s / 0.051 s against 0.303 s (one slow before-run); no "
        "slowdown beyond the runs' spread."
    ),
    "sessions-1xH100-owner-before.json": (
        "the same before (abe6809) between `sessions-1xH100-owner-after.json` and "
        "`sessions-1xH100-owner-after-again.json` on that H100: per session call 0.086 s / 0.092 s after against "
        "0.088 s before, hot 2.10 s / 2.22 s against 2.39 s, warm 14.25 s / 15.01 s against 14.46 s: no slowdown. The "
        "first warm call of the first run (20.1 s) came on a machine just started."
    ),
    "sessions-1xH100-took-before.json": (
        "the code before a session's rank says when it took a call (abe6809), run between "
        "`sessions-1xH100-took-after.json` and `sessions-1xH100-took-after-again.json` (27a2cfc, which adds one "
        "line on the rank's pipe per session call) on one H100 in one session: per session call 0.18 s / 0.15 s "
        "after against 0.16 s before, hot 3.66 s / 2.82 s against 3.42 s, warm 24.2 s / 24.4 s against 24.2 s: no "
        "slowdown. This machine ran every call slower than the H100 of the `owner` runs, before and after alike."
    ),
    "flight-recorder-1xH100-watchdog.log": (
        "`flight_recorder_gpu.py` on one H100 (2026-12-06), with py-spy run under its watchdog (`timeout`, outside "
        "the rank): a GPU rank blocked in `torch.cuda.synchronize()` gives its native frames in 0.35 s "
        "(`cudaDeviceSynchronize` under `synchronize`), as before the watchdog."
    ),
    "gpu-tests-1xH100-watchdog.log": (
        "`test_gpu.py` and `test_watch_gpu.py` on that H100 after py-spy got its watchdog: 8 passed in 85 s."
    ),
    "call_patterns-1xH100-owner-before.json": (
        "the same before (abe6809) between `call_patterns-1xH100-owner-after.json` and "
        "`call_patterns-1xH100-owner-after-again.json` on that H100 (medians of calls 2-5): a sweep's bare call "
        "1.189 s / 1.191 s after against 1.187 s before, logging 1.208 s / 1.246 s against 1.254 s; a bare hot call "
        "0.029 s / 0.029 s against 0.031 s, logging 0.042 s / 0.046 s against 0.054 s: no slowdown. The paused first "
        "call misses its bound (2 x warm + 0.3 s) in all three runs, before as after: 2.96 s / 3.25 s against 3.07 s."
    ),
    "sessions-cpu-keeper-before.json": (
        "the code before one keeper of kept worlds in the calling process (0a1bf42), run between "
        "`sessions-cpu-keeper-after.json` and `sessions-cpu-keeper-after-again.json` (the code with it) on the 2-core "
        "machine, quiet, in one session, 1 rank: per call, session 1.55 s against 1.52 s / 1.49 s after, hot 3.52 s "
        "against 3.35 s / 3.55 s, warm 7.98 s against 7.77 s / 7.92 s: no slowdown. The first `after` run came right "
        "after a test run (its first warm call 30.5 s: cold caches)."
    ),
    "call_patterns-cpu-keeper-before.json": (
        "the same before/after/after-again run of `call_patterns.py --cpu --ranks 1` (medians of calls 2-5): a bare "
        "hot call 0.031 s against 0.054 s / 0.032 s after, a hot call logging to MLflow 0.050 s against 0.075 s / "
        "0.050 s, a sweep's bare call 0.081 s against 0.091 s / 0.087 s. The first `after` run was slower in every "
        "pattern (cold caches after a test run); the second matches `before`."
    ),
    "launch-1xH200.json": "each round runs the methods in turn, so a hot call follows a fresh-process call and "
    "waits for that call's ranks to finish exiting (results come back before the exits; the next call starts after "
    "them), which is most of the 0.12 s.",
    "launch-4xH200.json": "measured before ranks stopped destroying a process group left open and tearing CUDA "
    "down at exit, which saved 0.5–0.9 s per call on 2×H200; not measured again on 4 GPUs.",
    "mlflow_launch-cpu-before.json": "the code before MLflow was imported by the helper between calls; kept to "
    "compare with `mlflow_launch-cpu.json`, measured the same day on the same machine.",
    "call_patterns-1xH200-fresh-machine.json": "a second run on one H200, on a machine just started (its first "
    "imports slow: torchrun 15.9 s); 5 s after loading, the helper was still importing torch and then MLflow, and "
    "the paused first call waited for them.",
    "call_patterns-1xH200-no-roll-back.json": (
        "a third run on one H200, just started and slower than the others (torchrun 17.1 s, fresh-process calls "
        "11.2 s), with the helper no longer rolling back a preparation that a call or a second request needs. The "
        "helper's log in a probe of the same machine: torch preloaded in 3.3-4.5 s, then MLflow and its default "
        "store's code in 4.9-5.8 s more, done 8.8-10 s after loading; the call 5 s after loading waited for that."
    ),
    "call_patterns-1xH200-evening.json": (
        "a fourth run on one H200, the same code as the third, on a machine started for it (torchrun 15.4 s). The "
        "log of four helpers in two runs of `launch_phases.py --first-call --pause 5` on the same machine: torch "
        "preloaded in 2.9-3.5 s, then MLflow and its default store's code in 4.4-5.6 s more, done 7.5-9.4 s after "
        "loading; the call, made 5.2 s after loading, waited for that (its ranks started 2.2-4.2 s into it, its "
        "results were back after 4.1-5.7 s), after creating its MLflow run (1.1-1.8 s: the notebook's own MLflow "
        "preparation still ran at the call in every probe)."
    ),
    "ddp_wait-hook.json": (
        "the design before this one, a communication hook that reduced each bucket as DDP does and timed it (it was "
        "opt-in, `AIR_MAGIC_WATCH_DDP=1`), measured with this script's earlier version on the same machine the same "
        "day: two models in each call, the hook on the one made first (not swapped; a later run that swapped them "
        "every other round met a loaded machine and was dropped). With any hook DDP no longer folds the division by "
        "the world size into its copy of the gradients into the buckets, so the hook divides them in one more pass "
        "(about 3 % of the 128 MiB model's step here), and each bucket costs a Python call and a Python callback on "
        "gloo's thread; the design now measured (`ddp_wait.json`: one model, measured and not by turns) registers no "
        "hook."
    ),
    "call_patterns-cpu-loaded.json": (
        "run while other jobs loaded the 2 cores (load 6-12): 5 s after loading, the notebook was still "
        "importing MLflow and creating the fresh store's tables (2.6-3.3 s of its CPU fell in the first call "
        "in probes of the same pattern at load 8-9), so the paused first call waited for that. Once that work"
        " is over (a 30 s pause, load 13-19), the first call's own CPU in the notebook is 0.11-0.17 s against"
        " 0.08 s for a warm call; before the background work ended with a full garbage collection it was "
        "0.37-0.54 s, of which that collection was 0.20-0.23 s."
    ),
}


def notes(names: Iterable[str]) -> list[str]:
    found = [f"- `{n}`: {NOTES[n]}" for n in names if n in NOTES]
    return [*found, ""] if found else []


def source_line(names: Iterable[str]) -> str:
    return "From " + ", ".join(f"`results/{n}`" for n in names) + "."


# --- one section per topic ------------------------------------------------------------------------------------------

LAUNCH_COLUMNS = [
    ("first call", "air_magic first call (starts helper)"),
    ("warm", "air_magic warm"),
    ("hot (`keep_alive`)", "air_magic hot (keep_alive)"),
    ("hot, logs to MLflow", "air_magic hot, logs to MLflow"),
    ("fresh processes (`warm=False`)", "air_magic fresh processes (warm=False)"),
    ("torchrun", "torchrun"),
    ("accelerate `notebook_launcher`", "accelerate notebook_launcher"),
]


def launch() -> list[str]:
    names = matching("launch.json") + matching("launch-*.json")
    rows = []
    for name in names:
        d = load(name)
        med = d.get("median", {})
        warm = med.get("air_magic warm")
        torchrun = med.get("torchrun")
        ratio = f"{torchrun / warm:.0f}×" if warm and torchrun else "–"
        rows.append(
            [f"{machine_of(d, name)}", date_of(d), d.get("ranks", "?")]
            + [s(med.get(key)) for _, key in LAUNCH_COLUMNS]
            + [ratio, f"`{name}`"]
        )
    return [
        "## Launch",
        "",
        "`bench/launch.py`: one trivial job (init the process group, all-reduce one tensor, destroy the group),",
        "timed from the call to the results back in a real Jupyter kernel, every launcher in the same run;",
        "medians. GPUs and NCCL where the node has them, else CPU workers and gloo.",
        "",
        *table(
            ["machine", "date", "ranks", *(c for c, _ in LAUNCH_COLUMNS), "torchrun ÷ warm", "file"],
            rows,
        ),
        *notes(names),
    ]


def ddp_step() -> list[str]:
    names = matching("ddp_step*.json")
    rows = []
    for name in names:
        d = load(name)
        ours = statistics.median(d["air_magic_step_s"]) * 1000
        theirs = statistics.median(d["torchrun_step_s"]) * 1000
        device = "GPU" if d.get("gpu") else "CPU"
        rows.append(
            [
                machine_of(d, name) if device == "GPU" else f"CPU, machine {machine_of(d, name)}",
                date_of(d),
                d.get("ranks", "?"),
                f"{ours:.2f} ms",
                f"{theirs:.2f} ms",
                f"{d['ratio']:.3f}",
                f"`{name}`",
            ]
        )
    return [
        "## Training step",
        "",
        "`bench/ddp_step.py`: the same DDP loop (`bench/ddp_job.py`) under air_magic and under torchrun,",
        "interleaved in rounds; median step time over the rounds. A ratio near 1 means air_magic costs",
        "training nothing.",
        "",
        *table(["machine", "date", "ranks", "air_magic step", "torchrun step", "ratio", "file"], rows),
    ]


def watch() -> list[str]:
    names = matching("watch*.json")
    rows = []
    for name in names:
        d = load(name)
        on = statistics.median(d["watched_step_s"]) * 1000
        off = statistics.median(d["unwatched_step_s"]) * 1000
        work = d.get("per_step_work", {})
        extra = work.get("batch_on_us", 0) + work.get("collective_on_us", 0)
        rows.append(
            [
                machine_of(d, name),
                date_of(d),
                d.get("load", NOT_RECORDED),
                "GPU" if d.get("gpu") else "CPU",
                d.get("ranks", "?"),
                f"{on:.2f} ms",
                f"{off:.2f} ms",
                f"{d['ratio']:.3f}",
                f"{extra:.1f} µs",
                f"`{name}`",
            ]
        )
    return [
        "## Watching a run",
        "",
        "`bench/watch.py`: the same DDP loop with a DataLoader and an all_reduce per step, `watch=True` and",
        "`watch=False` in alternating rounds; median step. The last column is the rank's patches' own work per step",
        "(one batch and one collective, watched), timed without ranks.",
        "",
        *table(
            [
                "machine",
                "date",
                "load",
                "device",
                "ranks",
                "watched step",
                "unwatched step",
                "ratio",
                "patches",
                "file",
            ],
            rows,
        ),
    ]


def ddp_wait() -> list[str]:
    names = matching("ddp_wait*.json")
    rows = []
    for name in names:
        d = load(name)
        for c in d["configs"]:
            measured = statistics.median(r["measured_step_s"] for r in c["rounds"]) * 1000
            plain = statistics.median(r["plain_step_s"] for r in c["rounds"]) * 1000
            rows.append(
                [
                    machine_of(d, name),
                    date_of(d),
                    "–".join(f"{x:.1f}" for x in (min(d["load"]), max(d["load"]))) if d.get("load") else NOT_RECORDED,
                    f"{d['ranks']} {'GPU' if d.get('gpu') else 'CPU'} ({d.get('backend', '?')})",
                    d.get("design", NOT_RECORDED),
                    f"{c['params_mib']:.0f} MiB, {c['bucket_mb']:g} MB buckets ({c['buckets']})",
                    f"{measured:.2f} ms",
                    f"{plain:.2f} ms",
                    f"{c['ratio']:.3f}",
                    ", ".join(f"{r['ratio']:.3f}" for r in c["rounds"]),
                    f"{d['per_step_work']['added_us']:.0f} µs" if d.get("per_step_work") else "–",
                    f"`{name}`",
                ]
            )
    return [
        "## Measuring DDP's all-reduce wait",
        "",
        "`bench/ddp_wait.py`: one DDP model in the ranks of a watched call, trained in blocks of steps with the",
        "watch's measure of DDP's all-reduce wait (on by default) and without it (`AIR_MAGIC_WATCH_DDP=0`) by turns;",
        "median step per round, and the median of the rounds' ratios (measured / plain; the rounds' own ratios beside",
        "it). The measure's own work a step is timed in the bench's process without ranks: a small layer's forward",
        "and backward with it and without. On one GPU (NCCL) the measure costs about 50 µs a step: 2.4 % of a 2 ms",
        "step of the small model, 0.5 % of the 4.2 ms step of the 128 MiB one, 0.1 % of the 41 ms GPT-2-small step",
        "of `memory_history.py`'s runs (`AIR_MAGIC_WATCH_DDP=0` turns it off where steps are that short).",
        "",
        *table(
            [
                "machine",
                "date",
                "load",
                "ranks",
                "design",
                "model (buckets a step)",
                "measured step",
                "plain step",
                "ratio",
                "rounds",
                "own work a step",
                "file",
            ],
            rows,
        ),
        *notes(names),
    ]


def faults() -> list[str]:
    name = "faults.json"
    d = load(name)
    rows = [
        [
            sc["scenario"],
            sc["runs"],
            ", ".join(sc["errors"]),
            "yes" if sc.get("rank_named") else "no",
            f"{sc['fault_to_return_s']['median']:.2f} s / {sc['fault_to_return_s']['max']:.2f} s",
            sc["processes_leaked"],
            sc["lines_lost"],
        ]
        for sc in d["scenarios"]
    ]
    return [
        "## Faults",
        "",
        "`bench/faults.py`: the fault scenarios of `tests/test_faults.py`, several runs each; time from the",
        "fault to the call's return, processes left behind and lines missing from the logs.",
        "",
        f"Machine: {machine_of(d, name)}. Date: {date_of(d)}. Stop grace: {d.get('stop_grace_s', '?')} s. "
        + source_line([name]),
        "",
        *table(
            [
                "scenario",
                "runs",
                "error raised",
                "rank named",
                "fault → return (median / max)",
                "processes leaked",
                "lines lost",
            ],
            rows,
        ),
    ]


def panel() -> list[str]:
    name = "panel.json"
    d = load(name)
    rows = [
        ["Shift+Enter → air_magic's first output, a kernel's first call", ms(d["panel_shown_first_call_ms"])],
        ["the same, later calls", ", ".join(ms(x) for x in d["panel_shown_later_calls_ms"])],
        ["Shift+Enter → a rank's first line, a kernel's first call", ms(d["first_line_first_call_ms"])],
        ["the same, later calls", ", ".join(ms(x) for x in d["first_line_later_calls_ms"])],
        [
            "a worker's `print` → the line in the panel (median / 95th percentile)",
            f"{ms(d['latency_median_ms'])} / {ms(d['latency_p95_ms'])}",
        ],
        [
            "`log_metric` → its point in the chart (median / max)",
            f"{ms(d['chart_lag_median_ms'])} / {ms(d['chart_lag_max_ms'])}",
        ],
        [
            f"kernel CPU while 2 ranks print {d['flood_rate_mb_s_per_rank']} MB/s each",
            f"{d['kernel_cpu_percent_during_flood']} % of one core",
        ],
        [
            "page answers during that flood (median / max)",
            f"{ms(d['page_answer_median_ms'])} / {ms(d['page_answer_max_ms'])}",
        ],
    ]
    tee = load("metrics_tee.json")
    tee_rows = [
        ["`mlflow.log_metric`", f"{tee['median_plain_metric_us']} µs", f"{tee['median_tee_alone_metric_us']} µs"],
        [
            "`mlflow.log_metrics` (4 values)",
            f"{tee['median_plain_metrics4_us']} µs",
            f"{tee['median_tee_alone_metrics4_us']} µs",
        ],
    ]
    return [
        "## The live panel",
        "",
        "`bench/panel_latency.py`: JupyterLab in headless Chromium, 2 CPU ranks.",
        "",
        f"Machine: {machine_of(d, name)}. Date: {date_of(d)}. Load average: {load_of(d)}. " + source_line([name]),
        "",
        *table(["what", "figure"], rows),
        "`bench/metrics_tee.py`: what the charts' copy of each logged value costs a training step (CPU time",
        f"of the calling thread, medians of {tee['rounds']} × {tee['calls_per_round']} calls).",
        "",
        f"Machine: {machine_of(tee, 'metrics_tee.json')}. Date: {date_of(tee)}. Load average: {load_of(tee)}. "
        + source_line(["metrics_tee.json"]),
        "",
        *table(["call", "MLflow's own call", "the copy for the charts"], tee_rows),
    ]


def mlflow_launch() -> list[str]:
    names = matching("mlflow_launch*.json")
    rows = []
    for name in names:
        d = load(name)
        for variant, v in d["variants"].items():
            for key, med in v.items():
                if not key.endswith(" median"):
                    continue
                ranks = key.split()[0]
                off, bare, logs = med.get("no MLflow"), med.get("bare"), med.get("logs")
                diff = f"+{logs - off:.3f} s" if logs is not None and off is not None else "–"
                rows.append(
                    [
                        machine_of(d, name),
                        date_of(d),
                        load_of(d),
                        variant,
                        ranks,
                        s(off),
                        s(bare),
                        s(logs),
                        diff,
                        f"`{name}`",
                    ]
                )
    return [
        "## MLflow at launch",
        "",
        '`bench/mlflow_launch.py`: warm calls, MLflow\'s default local store, medians. "no MLflow" is `return 1`',
        'with `mlflow=False`; "bare" the same with tracking on; "logs" is',
        '`import mlflow; mlflow.log_metric("x", 1.0); return 1`. `-before` files hold a run of an earlier',
        "version of the code, kept for comparison.",
        "",
        *table(
            ["machine", "date", "load", "helper", "ranks", "no MLflow", "bare", "logs", "logs − no MLflow", "file"],
            rows,
        ),
        *notes(names),
    ]


def first_calls() -> list[str]:
    names = matching("mlflow_first_calls*.json")
    rows = []
    for name in names:
        d = load(name)
        for scenario, v in d.get("first calls", {}).get("scenarios", {}).items():
            rows.append(
                [
                    machine_of(d, name),
                    date_of(d),
                    load_of(d),
                    scenario,
                    s(v.get("first s")),
                    s(v.get("second s")),
                    s(v.get("warm median s")),
                    s(v.get("bound s")),
                    f"`{name}`",
                ]
            )
    return [
        "## The first calls after `%load_ext`",
        "",
        "`bench/mlflow_launch.py --parts first`: a fresh kernel, `%load_ext air_magic` (or `import air_magic`),",
        "a pause or none, then calls of a 2-rank gloo all-reduce with MLflow on (a fresh default store). The",
        "bound is 1.5 × the warm median + 0.3 s. `-before` files hold a run of an earlier version of the code.",
        "",
        *table(["machine", "date", "load", "scenario", "first", "second", "warm (median)", "bound", "file"], rows),
    ]


def call_patterns() -> list[str]:
    names = matching("call_patterns*.json")
    rows = []
    for name in names:
        d = load(name)
        where = f"{machine_of(d, name)}, {d.get('ranks', '?')} ranks"
        for pattern, v in d.get("summary", {}).items():
            if pattern == "yardsticks":
                rows += [
                    [where, date_of(d), load_of(d), k.removesuffix(" s"), s(x), "", "", "", ""] for k, x in v.items()
                ]
                continue
            rows.append(
                [
                    where,
                    date_of(d),
                    load_of(d),
                    pattern,
                    s(v["s"]),
                    f"{v['against']}: {s(v['against s'])}",
                    f"{v['ratio']:.2f}" if v.get("ratio") is not None else "–",
                    s(v["bound s"]),
                    "yes" if v["within bound"] else "**no**",
                ]
            )
    return [
        "## Call patterns",
        "",
        "`bench/call_patterns.py`: the same all-reduce job (logging one MLflow metric per rank unless bare) in a",
        "fresh process per pattern, MLflow's default local store: Run All (`%load_ext` and the first call at once),",
        "a 5 s pause, sweeps of warm and of hot (`keep_alive`) calls, and as yardsticks fresh processes",
        "(`warm=False`) and torchrun. Bounds: Run All ≤ a fresh-process first call + 0.3 s; paused first call",
        "≤ 1.5 × warm + 0.3 s on CPU (2 × on GPUs); logging calls 2-5 ≤ bare calls 2-5 + 0.3 s (medians).",
        "",
        *table(["machine", "date", "load", "pattern", "time", "against", "ratio", "bound", "within"], rows),
        source_line(names),
        "",
        *notes(names),
    ]


def mlflow_logging() -> list[str]:
    names = matching("mlflow_logging-*.json")
    rows = []
    for name in names:
        d = load(name)
        rows.append(
            [
                machine_of(d, name),
                date_of(d),
                d.get("mlflow", "?"),
                f"{d['ranks']} × {d['steps']}",
                f"{d['stored_metrics']} / {d['expected_metrics']}",
                d["database_locked_errors"],
                f"{d['cpu_us_per_log_metric']} µs",
                f"{d['wall_us_per_log_metric']} µs",
                f"{d['default_sync_one_process_wall_us']} µs",
                f"`{name}`",
            ]
        )
    return [
        "## MLflow logging in the ranks",
        "",
        "`bench/mlflow_logging.py`: every rank logs `loss` at each step (2 ms of busy work per step) to MLflow's",
        "default sqlite store; CPU and wall time per `mlflow.log_metric` (asynchronous, batched) in the ranks,",
        "and a synchronous `log_metric` in one plain process for comparison.",
        "",
        *table(
            [
                "machine",
                "date",
                "MLflow",
                "ranks × steps",
                "stored / logged",
                '"database is locked"',
                "CPU per call",
                "wall per call",
                "synchronous, one process",
                "file",
            ],
            rows,
        ),
    ]


def data_read() -> list[str]:
    name = "data_read.json"
    d = load(name)
    m = d.get("machine", {})
    machine = f"{m.get('cpus', '?')} CPU cores, {m.get('platform', '?')}" if isinstance(m, dict) else str(m)
    rows = [[reader, r["files_per_s"], r["MB_per_s"], f"{r['seconds']:.3f}"] for reader, r in d["results"].items()]
    summary = d.get("summary", {})
    return [
        "## Data reading",
        "",
        "`bench/data_read.py`: every file read once per measurement, from an S3 API on 127.0.0.1 (moto's",
        "server, in the benchmark's process, sharing the machine's cores: it measures the cache, not a real",
        "object store) and from local disk; medians.",
        "",
        f"Machine: {machine}. Date: {date_of(d)}. Load average: {load_of(d)}. "
        f"{d['files']} files of {d['file_size_bytes'] // 1024} KiB, {d['workers']} DataLoader workers, "
        f"batch {d['batch_size']}. " + source_line([name]),
        "",
        *table(["reader", "files/s", "MB/s", "seconds (median)"], rows),
        *[f"- {k.replace('_', ' ')}: {v}" for k, v in summary.items()],
        "",
    ]


def ray() -> list[str]:
    lines = [
        "## Ray",
        "",
        "`bench/ray_launch.py`: a trivial all-reduce through the local launcher and through the Ray launcher",
        "(`num_nodes=2`) on the tests' simulated cluster (a head and two 2-CPU nodes on 127.0.0.1), alternating,",
        "with Ray Train's `TorchTrainer` of the same job as the yardstick. `-before` files hold a run of an",
        "earlier version of the code, kept for comparison (`-before-spares`: every cold call started new Ray",
        "workers). Where the file says so, cold calls after the first ran in the spare actors the call before left,",
        "with a pause between rounds, and hot calls with MLflow on compare a call that logs one metric with a bare",
        "one.",
        "",
    ]
    for name in matching("ray_launch*.json"):
        d = load(name)
        rows = [
            ["start the simulated 3-node cluster", s(d["cluster_start_s"])],
            ["`ray_init(address)`: join it", s(d["ray_init_join_s"])],
        ]
        for what, times in d["seconds"].items():
            rows.append([f"{what}: first call", s(d["first_s"][what])])
            rows.append([f"{what}: later calls", ", ".join(s(t) for t in times[1:])])
            if d.get("median_s", {}).get(what) is not None:
                rows.append([f"{what}: median", s(d["median_s"][what])])
            if d.get("median_after_first_s", {}).get(what) is not None:
                rows.append([f"{what}: later calls, median", s(d["median_after_first_s"][what])])
        for key, label in (
            ("pause_between_rounds_s", "pause between rounds (a user between cells)"),
            ("later_cold_calls_ran_in_spares", "later cold calls ran in the spare actors left before them"),
            ("mlflow_logging_runs_with_every_rank_metric", "MLflow runs of the logging calls with every rank's metric"),
        ):
            if key in d:
                rows.append([label, s(d[key]) if key.endswith("_s") else str(d[key])])
        lines += [
            f"Machine: {machine_of(d, name)}. Date: {date_of(d)}. Load average: {load_of(d)}. " + source_line([name]),
            "",
            *table(["what", "seconds"], rows),
        ]
    for gname in matching("ray_gpu*.json"):
        g = load(gname)
        lines += [
            "`bench/ray_gpu.py`: the same seeded DDP training through the local launcher and through Ray on a",
            "GPU node.",
            "",
            f"Machine: {machine_of(g, gname)}. Date: {date_of(g)}. " + source_line([gname]),
            "",
            *table(
                ["what", "figure"],
                [
                    ["how", g.get("how", "?")],
                    ["local launcher, first call", s(g.get("local s"))],
                    [
                        "Ray launcher, first / second call",
                        f"{s(g.get('ray first call s'))} / {s(g.get('ray second call s'))}",
                    ],
                    [
                        "Ray launcher, keep_alive: first (cold) / second (hot) / third (hot) call",
                        " / ".join(
                            s(g.get(f"ray keep_alive {which} call s"))
                            for which in ("first (makes the hot ranks)", "second (hot)", "third (hot)")
                        ),
                    ],
                    [
                        "hot calls in the first one's processes",
                        "yes" if g.get("hot calls in the same processes") else "no",
                    ],
                    ["same losses through both", "yes" if g.get("same losses") else "no"],
                    [
                        "GPUs free in Ray afterwards / total",
                        " / ".join(map(str, g.get("ray GPUs free after / total", []))),
                    ],
                    [
                        "GPU MiB in use before / after",
                        " / ".join(
                            ", ".join(map(str, g.get(f"GPU MiB used {when}", []))) for when in ("before", "after")
                        ),
                    ],
                ],
            ),
        ]
    return lines


def gpu_demos() -> list[str]:
    rows = []
    names = matching("gpu_demos*.json")
    for name in names:
        d = load(name)
        for row in d["rows"]:
            for part, times in row.get("step_time_ms", {}).items():  # none from a failed demo or one timing no steps
                demo = row["notebook"].removesuffix(".ipynb") + (f" {part}" if part else "")
                rows.append(
                    [
                        demo,
                        ", ".join(row["ranks"]),
                        " / ".join(ms(t) for t in times),
                        f"{row['wall_s']} s",
                        machine_of(d, name),
                        date_of(d),
                        f"`{name}`",
                    ]
                )
    return [
        "## Demo notebooks on GPUs",
        "",
        "`bench/gpu_demos.py`: every demo notebook executed headless; median training step per rank (tiny",
        "models: the figures mostly show overhead).",
        "",
        *table(["demo", "ranks", "step per rank", "notebook wall time", "machine", "date", "file"], rows),
    ]


def raw_records() -> list[str]:
    rows = []
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in {".txt", ".log"}:
            first = path.read_text(errors="replace").strip().splitlines()[:1]
            rows.append([f"`results/{path.name}`", (first[0].strip() if first else "").replace("|", "\\|")[:100]])
    return [
        "## Raw records",
        "",
        "Logs and printed output kept as they were written (not tables); their first line:",
        "",
        *table(["file", "first line"], rows),
        "",
        *notes(p.name for p in sorted(RESULTS.iterdir()) if p.suffix in {".txt", ".log"}),
    ]


def sessions() -> list[str]:
    names = matching("sessions.json") + matching("sessions-*.json")
    if not names:
        return []
    rows = []
    for name in names:
        d = load(name)
        shape = d.get("shape", {})
        what = f"{shape.get('layers')} layers, d_model {shape.get('d_model')}, seq {shape.get('seq')}, " + (
            "compiled" if d.get("compile") else "not compiled"
        )
        for way in ("warm", "hot", "session"):
            rows.append(
                [
                    machine_of(d, name),
                    date_of(d),
                    load_of(d),
                    what,
                    way,
                    s(d["first_call_s"].get(way)),
                    s(d["median_s"].get(way)),
                    f"{d['ratio_to_session'][way]:.1f}×",
                ]
            )
    return [
        "## Sessions: ten training steps per call of a model that takes a while to build",
        "",
        (
            "`bench/sessions.py`: a GPT-style decoder from torch alone, built, wrapped in DDP and compiled, trained 10 "
            "steps per call: warm (built every call), hot (`keep_alive`, built every call), and a session cell that "
            "reuses the model built by the session's first cell. Median of the calls after the first; the ratio is to "
            "the session's."
        ),
        "",
        *table(["machine", "date", "load", "model", "way", "first call", "median call", "× session"], rows),
        source_line(names),
        "",
        *notes(names),
    ]


def profile_latency() -> list[str]:
    names = matching("profile_latency*.json")
    rows = []
    for name in names:
        d = load(name)
        shape = d["shape"]
        traces = [b for r in d["rounds"] for b in r["trace_bytes"].values()]
        rows.append(
            [
                machine_of(d, name),
                date_of(d),
                load_of(d),
                d["ranks"],
                f"{shape['batch']} x {shape['seq']}",
                s(statistics.median(r["step_s"] for r in d["rounds"])),
                s(d["latency_median_s"]),
                f"{max(traces) / 2**20:.1f} MiB",
                f"{max(r['merged_bytes'] for r in d['rounds']) / 2**20:.1f} MiB",
                f"`{name}`",
            ]
        )
    return [
        "## Profile latency",
        "",
        "`bench/profile_latency.py`: `profile=5` of a GPT-2-small-shaped decoder in DDP on every rank; from the end of",
        "the last profiled step (the latest rank's) to `JobResult.profile` in the caller (the ranks' trace export, the",
        "call's end, the analysis and the merged trace), median of the rounds.",
        "",
        *table(
            [
                "machine",
                "date",
                "load",
                "ranks",
                "tokens",
                "step",
                "latency",
                "largest rank trace",
                "merged trace",
                "file",
            ],
            rows,
        ),
        *notes(names),
    ]


def memory_history() -> list[str]:
    names = matching("memory_history*.json")
    rows = []
    for name in names:
        d = load(name)
        shape = d["shape"]
        rows.append(
            [
                machine_of(d, name),
                date_of(d),
                load_of(d),
                d["ranks"],
                f"{shape['batch']} x {shape['seq']}",
                ", ".join(f"{v:.1f}" for v in d["step_ms"]["off"]),
                ", ".join(f"{v:.1f}" for v in d["step_ms"]["on"]),
                f"{d['ratio_on_to_off']:.3f}",
                f"`{name}`",
            ]
        )
    return [
        "## Memory history",
        "",
        "`bench/memory_history.py`: the same DDP training of a GPT-2-small-shaped decoder with `memory_history` off",
        "and on, alternately, in one run; each round's median step (ms, the slowest rank's) and the ratio of the",
        "medians.",
        "air_magic keeps the history off by default unless it costs 1 % or less.",
        "",
        *table(
            ["machine", "date", "load", "ranks", "tokens", "step off (ms)", "step on (ms)", "on / off", "file"], rows
        ),
        *notes(names),
    ]


SECTIONS: list[Callable[[], list[str]]] = [
    launch,
    sessions,
    ddp_step,
    watch,
    ddp_wait,
    profile_latency,
    memory_history,
    faults,
    panel,
    mlflow_launch,
    first_calls,
    call_patterns,
    mlflow_logging,
    data_read,
    ray,
    gpu_demos,
    raw_records,
]


# --- the scripts ----------------------------------------------------------------------------------------------------


def scripts() -> list[str]:
    """Each script with the first paragraph of its docstring and its command lines."""
    rows = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name == Path(__file__).name:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        summary = doc.split("\n\n")[0].replace("\n", " ").strip()
        # Command lines as the docstrings write them, without a trailing comment or note after two spaces.
        commands = [
            line[line.find("python bench/") :].split("  ")[0] for line in doc.splitlines() if "python bench/" in line
        ]
        usage = "<br>".join(f"`{c}`" for c in commands) or "(no command line: another script runs it)"
        rows.append([f"`{path.name}`", summary.replace("|", "\\|"), usage.replace("|", "\\|")])
    return table(["script", "what it measures", "how to run it"], rows)


def render() -> str:
    lines = [
        "# Benchmarks",
        "",
        "<!-- Written by bench/report.py from bench/results/ and the scripts' docstrings; do not edit by hand:",
        "     run `python bench/report.py` after adding results. -->",
        "",
        "Each script below measures one thing and writes its figures to `bench/results/`; the tables that",
        "follow are generated from those files by `python bench/report.py`, with the machine, date and load",
        'average each file records ("not recorded" where it does not). Figures from a loaded or',
        "shared machine are inflated; compare rows of one file. `make bench` runs `bench/launch.py`; on a GPU",
        "node `bash bench/gpu_run.sh OUTDIR bench demos mlflow ...` runs the GPU benchmarks.",
        "",
        "## The scripts",
        "",
        *scripts(),
    ]
    for section in SECTIONS:
        lines += section()
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if bench/README.md is not current")
    args = ap.parse_args()
    text = render()
    if args.check:
        if README.read_text() != text:
            print("bench/README.md is not what bench/report.py writes; run: python bench/report.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(text)
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
