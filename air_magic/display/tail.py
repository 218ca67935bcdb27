"""A bounded tail of one rank's output, for a display that must survive floods.

Keeps the newest complete lines within a line and character budget, cuts
over-long lines, follows carriage-return progress bars, and counts what it
left out. Knows nothing about widgets; the full log always stays on disk.
"""

from __future__ import annotations

import html
from collections import deque

#: Newest lines a tab keeps.
MAX_LINES = 400
#: Characters a tab keeps in all (what one refresh sends to the browser, at most).
MAX_CHARS = 48 * 1024
#: Characters of one line a tab shows; the rest is counted.
MAX_LINE_CHARS = 2000


def _cut(line: str, limit: int) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit]} … [{len(line) - limit:,} more characters]"


class TailBuffer:
    """The newest lines of a stream of text, bounded, with a count of what was dropped."""

    def __init__(
        self, max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS, max_line_chars: int = MAX_LINE_CHARS
    ) -> None:
        self.max_lines = max_lines
        self.max_chars = max_chars
        self.max_line_chars = max_line_chars
        self.lines: deque[str] = deque()
        self.chars = 0
        self.partial = ""  # text after the last newline, already cut to max_line_chars
        self.partial_extra = 0  # characters of the partial line beyond what is kept
        self.total_lines = 0  # complete lines seen

    @property
    def omitted(self) -> int:
        """Complete lines seen but no longer kept."""
        return self.total_lines - len(self.lines)

    def feed(self, text: str) -> None:
        """Add text as it arrived (any number of lines, possibly ending mid-line)."""
        pieces = text.split("\n")
        if len(pieces) == 1:
            self._grow_partial(pieces[0])
            return
        self._grow_partial(pieces[0])
        first = self._finish(self.partial, self.partial_extra)
        middle = pieces[1:-1]
        self.total_lines += 1 + len(middle)
        # only the newest max_lines of a big chunk can survive: skip the rest unread
        keep = middle[-self.max_lines :] if len(middle) >= self.max_lines else middle
        if len(keep) < self.max_lines:
            self._append(first)
        for line in keep:
            self._append(self._finish(line, 0))
        self.partial, self.partial_extra = "", 0
        self._grow_partial(pieces[-1])

    def _grow_partial(self, piece: str) -> None:
        if "\r" in piece:  # a progress bar redrawing its line: only the last drawing counts
            piece = piece.rsplit("\r", 1)[1]
            self.partial, self.partial_extra = "", 0
        room = self.max_line_chars - len(self.partial)
        if len(piece) > room:
            self.partial += piece[: max(room, 0)]
            self.partial_extra += len(piece) - max(room, 0)
        else:
            self.partial += piece

    def _finish(self, line: str, extra: int) -> str:
        if "\r" in line:
            line = line.rstrip("\r").rsplit("\r", 1)[-1]
        line = _cut(line, self.max_line_chars)
        if extra:
            line = f"{line} … [{extra:,} more characters]"
        return line

    def _append(self, line: str) -> None:
        self.lines.append(line)
        self.chars += len(line) + 1
        while self.lines and (len(self.lines) > self.max_lines or self.chars > self.max_chars):
            self.chars -= len(self.lines.popleft()) + 1

    def text(self) -> str:
        """The kept lines and the unfinished last line, as plain text."""
        body = "\n".join(self.lines)
        if self.partial:
            body = f"{body}\n{self.partial}" if body else self.partial
        return body

    def note_html(self, log_path: str | None = None) -> str:
        """An escaped HTML note on how many lines were left out and where the full log is ('' if none)."""
        if not self.omitted:
            return ""
        where = f"; full log: {html.escape(log_path)}" if log_path else ""
        return (
            f'<div class="air-magic-omitted" style="color:#b35900;font-style:italic">'
            f"… {self.omitted:,} earlier line(s) not shown{where}</div>"
        )

    def body_html(self) -> str:
        """The kept text as an escaped HTML <pre>."""
        return f'<pre style="margin:0;white-space:pre-wrap;word-break:break-all">{html.escape(self.text())}</pre>'

    def html(self, log_path: str | None = None) -> str:
        """The note, then the tail, as escaped HTML."""
        return self.note_html(log_path) + self.body_html()
