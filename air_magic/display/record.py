"""The static record a call leaves in the notebook when it ends: HTML and plain text, no widget state.

The live panel is a widget: saved, converted or reopened without its kernel it
shows nothing. So when a call ends the panel's output is replaced by this
record: how it ended, how long it took, the MLflow link, each rank's last
lines (bounded, with a note of what was left out and where the full log is),
each rank's peak memory (and GPU memory) when they were sampled, the table of a
profiled call (profile.py), the stacks a
rank wrote when it was stopped (launch/stacks.py), the metric charts, and after
restarts the attempt it ended on and how each earlier one ended. It uses only
HTML that JupyterLab keeps in untrusted
notebooks (no scripts, no data attributes), and a text/plain twin for
nbconvert's text exporters and terminals. Knows nothing about widgets.
"""

from __future__ import annotations

import html
from pathlib import Path

from ..errors import DistributedTimeoutError, JobCancelledError
from ..job import JobResult, JobStatus
from ..launch.files.memory_snapshot import human_bytes
from ..launch.files.stack_dumps import Dump
from ..launch.stacks import STOPPING
from ..resources import Peak, peak_text
from .charts import MetricsTail, charts_html, charts_text
from .profile import profile_html
from .tail import TailBuffer

#: Newest lines of each rank kept in the record.
RECORD_LINES = 40
#: Characters of each rank kept in the record.
RECORD_CHARS = 8 * 1024
#: Characters of one line kept in the record.
RECORD_LINE_CHARS = 500

_PRE = (
    "margin:0;padding:4px 6px;white-space:pre-wrap;word-break:break-all;max-height:24em;overflow-y:auto;"
    "font-size:12px;line-height:1.35;background:#f7f7f7;border:1px solid #e0e0e0"
)


def ended_as(result: JobResult) -> str:
    """One word or two for how the call ended: finished, failed, cancelled, timed out, interrupted, stopped."""
    if result.status == JobStatus.FINISHED:
        return "finished"
    if result.status == JobStatus.FAILED:
        return "failed"
    if isinstance(result.error, JobCancelledError):
        return "cancelled"
    if isinstance(result.error, DistributedTimeoutError):
        return "timed out"
    if isinstance(result.error, KeyboardInterrupt):
        return "interrupted"
    return "stopped"


def record_tail(tail: TailBuffer) -> TailBuffer:
    """The newest lines of `tail` within the record's smaller budget, with the count of lines left out kept."""
    small = TailBuffer(max_lines=RECORD_LINES, max_chars=RECORD_CHARS, max_line_chars=RECORD_LINE_CHARS)
    lines = list(tail.lines)[-RECORD_LINES:]
    small.feed("".join(f"{line}\n" for line in lines) + tail.partial)
    small.total_lines = tail.total_lines  # what the big tail already dropped counts as left out too
    return small


def short_link_text(url: str) -> str:
    """A few characters that name the run in a header ('run 4b8c2e1f'), the full URL going in the tooltip."""
    tail = url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return f"run {tail[:8]}" if tail else "MLflow run"


def record_bundle(
    result: JobResult,
    tails: list[TailBuffer],
    log_paths: list[Path],
    link: str | None,
    metrics: MetricsTail | None = None,
    dumps: dict[int, list[Dump]] | None = None,
    peaks: dict[int, Peak] | None = None,
) -> dict[str, str]:
    """The record as a MIME bundle: {'text/html': ..., 'text/plain': ...}; `peaks`: what each rank used at most."""
    spec = result.spec
    how = ended_as(result)
    color = {"finished": "#2e7d32", "failed": "#c62828"}.get(how, "#b35900")
    head = (
        f"<b>{html.escape(spec.name)}</b> · {spec.world_size} rank(s) · {html.escape(spec.accelerator_type)} · "
        f'<b style="color:{color}">{how}</b> in {result.elapsed:.1f} s'
    )
    attempts = f"attempt {result.attempts} of {1 + spec.max_restarts}" if result.attempts > 1 else ""
    if attempts:
        head += f' · <span class="air-magic-record-attempt">{attempts}</span>'
    if link:
        head += (
            f' · <a href="{html.escape(link, quote=True)}" target="_blank" title="{html.escape(link, quote=True)}">'
            f"MLflow {html.escape(short_link_text(link))}</a>"
        )
    parts = [
        '<div class="air-magic-record" style="font-family:var(--jp-ui-font-family,sans-serif);font-size:13px">',
        f'<div class="air-magic-record-head" style="margin-bottom:4px">{head}</div>',
    ]
    earlier = [f"attempt {n + 1}: {why}" for n, why in enumerate(result.earlier_failures)]
    if earlier:
        parts.append(
            '<div class="air-magic-record-attempts" style="color:#777;font-size:12px;margin-bottom:4px">'
            "earlier attempts ended with: " + "; ".join(html.escape(line) for line in earlier) + "</div>"
        )
    if result.alerts:  # what the watch saw (watching/): stragglers and hangs
        parts.append(
            '<div class="air-magic-record-alerts" style="color:#b26a00;font-size:12px;margin-bottom:4px">'
            + "".join(f"<div>⚠ {html.escape(a.message)}</div>" for a in result.alerts)
            + "</div>"
        )
    if result.profile is not None:  # profile=N (profiling/): every rank's profiled steps
        parts.append(profile_html(result.profile))
    parts.append(charts_html(metrics))
    text = [
        f"air_magic: {spec.name} on {spec.world_size} rank(s), {spec.accelerator_type}: {how}"
        + (f" on {attempts}" if attempts else "")
        + f" in {result.elapsed:.1f} s",
    ]
    text += [f"earlier {line}" for line in earlier]
    text += [alert.message for alert in result.alerts]
    if result.profile is not None:
        text += result.profile.table().split("\n")
    if link:
        text.append(f"MLflow run: {link}")
    text.append(f"logs: {result.run_dir}")
    metric_lines = charts_text(metrics)
    if metric_lines:
        text.append(metric_lines)
    for rank in result.ranks:
        small = record_tail(tails[rank.rank])
        log = str(log_paths[rank.rank])
        note = f"… {small.omitted:,} earlier line(s) not shown; full log: {log}" if small.omitted else f"log: {log}"
        title = f"rank {rank.rank}: {rank.state.value}"
        if peaks and rank.rank in peaks:
            title += f" · {peak_text(peaks[rank.rank])}"
        if rank.gpu_peak_allocated is not None:  # torch's own counter (profiling/memory.py)
            title += f" · peak allocated by torch {human_bytes(rank.gpu_peak_allocated)}"
        stopped = [d for d in (dumps or {}).get(rank.rank, []) if d.why == STOPPING]
        stack_html = "".join(
            f'<details class="air-magic-record-stacks" style="margin:2px 0 2px 1em"><summary style="cursor:pointer">'
            f'{html.escape(d.summary())}</summary><pre style="{_PRE}">{html.escape(d.text())}</pre></details>'
            for d in stopped
        )
        parts.append(
            f'<details class="air-magic-record-rank" open style="margin:2px 0">'
            f'<summary style="cursor:pointer">{html.escape(title)}</summary>'
            f'<div class="air-magic-record-note" style="color:#777;font-style:italic;font-size:12px">'
            f"{html.escape(note)}</div>{stack_html}"
            f'<pre class="air-magic-record-log" style="{_PRE}">{html.escape(small.text())}</pre></details>'
        )
        body = small.text()
        text.append(f"--- {title} ({note})")
        for dump in stopped:
            text.extend(f"[rank {rank.rank} stacks] {line}" for line in dump.text().split("\n"))
        text.extend(f"[rank {rank.rank}] {line}" for line in body.split("\n") if body)
    parts.append("</div>")
    return {"text/html": "".join(parts), "text/plain": "\n".join(text)}
