"""What the panel keeps of a rank's stacks (display/rank_tabs.py), as plain objects: no kernel, no rank."""

from __future__ import annotations

from air_magic.display.rank_tabs import RankTabs
from air_magic.launch.files.stack_dumps import STOPPING, Dump


def test_stacks_taken_before_the_stop_stay_when_a_request_is_answered_after_them():
    """A Stacks click that races Cancel is answered after the stop's dump: the record keeps the stop's stacks; a
    request before the stop is replaced by the stop's as before."""
    tabs = RankTabs(1, None, usage_shown=False)
    asked, stopped, late = (
        Dump(7, "the rank", why, clock) for why, clock in (("on request", "1"), (STOPPING, "2"), ("on request", "3"))
    )
    for dump in (asked, stopped, late):
        tabs.take_dumps(0, [dump])
    assert tabs.dumps[0] == [stopped]


def test_an_alert_for_a_rank_without_a_tab_leaves_the_tabs_as_they_are():
    """A command's launcher may start more ranks than the run has units (tabs): the watch's alert for rank 3 of a
    2-tab panel changes no tab (it raised IndexError in the panel's poll); rank 1's badge is its tab's."""
    tabs = RankTabs(2, None, usage_shown=False)
    tabs.badge(3, "hung", set())
    tabs.badge(1, "straggler (compute)", set())
    assert tabs.badges == {1: "straggler (compute)"}
    assert tabs.tabs.get_title(1).endswith("⚠ straggler (compute)") and "⚠" not in tabs.tabs.get_title(0)
