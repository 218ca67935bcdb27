"""Plain-text display: every rank's lines prefixed with the rank, the run link printed once.

Used outside Jupyter (scripts, terminal IPython) and wherever widgets cannot
show. Writes to the caller's sys.stdout, whole lines only, so lines of
different ranks never interleave mid-line.
"""

from __future__ import annotations

import sys
from typing import TextIO

from ..job import JobResult, RankState
from ..listeners import Listener, RunContext


class TextDisplay(Listener):
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.partial: dict[int, str] = {}

    @property
    def out(self) -> TextIO:
        return self.stream or sys.stdout

    def on_start(self, ctx: RunContext) -> None:
        spec = ctx.spec
        self.out.write(
            f"air_magic: {spec.name} on {spec.world_size} rank(s), {spec.accelerator_type}"
            f"{'' if spec.session is None else f' in session {spec.session!r}'}; logs in {ctx.run_dir}\n"
        )
        self.ctx = ctx
        self.link_shown = False
        self.alerts_shown = 0
        self.show_link()

    def show_link(self) -> None:
        link = self.ctx.links.get("mlflow")
        if link and not self.link_shown:
            self.out.write(f"air_magic: MLflow run: {link}\n")
            self.link_shown = True

    def poll(self) -> None:
        self.show_link()  # the run is made in the background: print its link once it exists
        self.show_alerts()

    def show_alerts(self) -> None:
        """One line per new alert of the watch (watching/): a straggler or a hung rank."""
        alerts = self.ctx.alerts
        for alert in alerts[self.alerts_shown :]:
            self.out.write(f"air_magic: {alert.message}\n")
            self.out.flush()
        self.alerts_shown = len(alerts)

    def on_output(self, rank: int, text: str) -> None:
        text = self.partial.pop(rank, "") + text.replace("\r\n", "\n")
        lines = text.split("\n")
        self.partial[rank] = lines.pop()
        if lines:
            self.out.write("".join(f"[rank {rank}] {line}\n" for line in lines))
            self.out.flush()

    def on_attempt(self, attempt: int, why: str) -> None:
        for rank in list(self.partial):
            self.flush_rank(rank)
        self.out.write(
            f"air_magic: {self.ctx.spec.name}: attempt {attempt + 1} of {self.ctx.attempts_allowed}, "
            f"every rank starts again after: {why}\n"
        )
        self.out.flush()

    def on_rank_state(self, rank: int, state: RankState) -> None:
        if state in (RankState.FAILED,):
            self.flush_rank(rank)

    def flush_rank(self, rank: int) -> None:
        rest = self.partial.pop(rank, "")
        if rest:
            self.out.write(f"[rank {rank}] {rest}\n")

    def on_end(self, result: JobResult) -> None:
        for rank in list(self.partial):
            self.flush_rank(rank)
        self.show_link()
        self.show_alerts()
        if result.profile is not None:  # profile=N (profiling/): the table of every rank's profiled steps
            self.out.write("".join(f"air_magic: {line}\n" for line in result.profile.table().split("\n")))
        attempts = f" after {result.attempts} attempts" if result.attempts > 1 else ""
        self.out.write(
            f"air_magic: {result.spec.name} {result.status.value.lower()}{attempts} in {result.elapsed:.1f} s\n"
        )
        self.out.flush()
