"""The display's plain parts: choosing a display mode, and the bounded tail of a rank's output."""

from __future__ import annotations

import pytest

from air_magic.display.tail import TailBuffer


def test_an_unknown_display_mode_is_a_clear_error(monkeypatch):
    """AIR_MAGIC_DISPLAY with an unknown value names the valid choices."""
    from air_magic.display import make_display
    from air_magic.errors import ConfigurationError

    monkeypatch.setenv("AIR_MAGIC_DISPLAY", "fancy")
    with pytest.raises(ConfigurationError, match="auto, panel, text"):
        make_display(None)  # type: ignore[arg-type]


def test_tail_buffer_bounds_lines_cuts_long_lines_and_counts_what_it_dropped():
    """The tail keeps the newest lines within its budgets, cuts huge lines, and counts every line it left out."""
    tail = TailBuffer(max_lines=3, max_chars=1000, max_line_chars=10)
    tail.feed("a\nb\nc")
    tail.feed("\nd\n" + "y" * 25 + "\nprogress 1\rprogress 2\rprog")
    tail.feed("ress 3")
    assert tail.total_lines == 5 and tail.omitted == 2
    assert list(tail.lines) == ["c", "d", "yyyyyyyyyy … [15 more characters]"]
    assert tail.partial == "progress 3"
    tail.feed("\n" + "\n".join(str(i) for i in range(10_000)) + "\n")
    assert list(tail.lines) == ["9997", "9998", "9999"] and tail.omitted == 10_003
    assert "10,003 earlier line(s) not shown; full log: /x/rank-0.log" in tail.html("/x/rank-0.log")
    small = TailBuffer(max_lines=100, max_chars=20)
    small.feed("0123456789\n0123456789\nabc\n")
    assert list(small.lines) == ["0123456789", "abc"] and small.omitted == 1
    escaped = TailBuffer()
    escaped.feed("<b>x</b>\n")
    assert "&lt;b&gt;x&lt;/b&gt;" in escaped.html() and "<b>x" not in escaped.html()
