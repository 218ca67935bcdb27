"""The panel's header: the status line on a row of its own, wrapping rather than cut, and the link with the buttons
(made by one factory) in a row under it, each button doing its one thing when clicked."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import SimpleNamespace

from air_magic.display.widgets import Panel
from air_magic.job import JobSpec
from air_magic.listeners import RunContext


def _started(tmp_path: Path, name: str = "f") -> Panel:
    spec = JobSpec(
        target=print, args=(), kwargs={}, name=name, world_size=2, accelerator_type="CPU", timeout=None, mlflow=True
    )
    ctx = RunContext(spec, tmp_path, [tmp_path / "rank-0.log", tmp_path / "rank-1.log"])
    panel = Panel()
    with contextlib.redirect_stdout(io.StringIO()):  # outside a kernel, display() prints
        panel.on_start(ctx)
    panel.handle = SimpleNamespace(update=lambda *args, **kwargs: None)
    return panel


def test_the_status_line_has_its_own_row_and_wraps_instead_of_being_cut(tmp_path):
    """Row one: the status alone, full width, no ellipsis; row two: link, Stacks, Profile, Stop, Cancel, the hint."""
    panel = _started(tmp_path, name="a_training_function_with_a_long_name_" * 4)
    header = panel.box.children[0]
    assert "air-magic-header" in header._dom_classes
    status, controls = header.children
    assert status is panel.status and status.layout.width == "100%"
    assert "ellipsis" not in panel.status.value and "nowrap" not in panel.status.value.split(">")[0]
    assert "white-space:normal" in panel.status.value
    assert controls.children == (
        panel.link,
        panel.stacks_button,
        panel.profile_button,
        panel.stop_button,
        panel.cancel_button,
        panel.cancel_hint,
    )
    assert controls.layout.flex_flow == "row wrap"


def test_every_header_button_comes_from_the_factory_and_does_its_one_thing(tmp_path):
    """Each button keeps its width and class; outside a kernel, where a click could not come while the cell runs,
    none is shown and the hint names the interrupt button; a click sets only its own flag."""
    panel = _started(tmp_path)
    assert panel.ctx is not None
    buttons = {"air-magic-stacks-button": panel.stacks_button, "air-magic-stop": panel.stop_button}
    buttons["air-magic-profile-button"] = panel.profile_button
    buttons["air-magic-cancel"] = panel.cancel_button
    for css, button in buttons.items():
        assert css in button._dom_classes and button.layout.flex == "0 0 auto"
        assert button.layout.display == "none"
    assert panel.cancel_button.button_style == "danger" and panel.cancel_button.layout.min_width == "9.5em"
    assert "interrupt button" in panel.cancel_hint.value
    panel.stacks_button.click()
    assert panel.ctx.take_stacks_request() and not panel.ctx.cancelled and not panel.ctx.stop_requested
    panel.stop_button.click()
    assert panel.ctx.stop_requested and not panel.ctx.cancelled
    panel.cancel_button.click()
    assert panel.ctx.cancelled


def test_the_profile_button_asks_the_ranks_and_shows_what_it_found(tmp_path):
    """A click leaves the request the ranks' watch reads (request 1, 5 steps, from step 0); a call that ended before
    any rank profiled shows why in the Profile tab (added after the ranks' tabs, and selected), and the button is
    free again; a second answer goes to the same tab."""
    import time

    from air_magic.launch.files import profile_windows
    from air_magic.launch.files.rundir import RunDir

    panel = _started(tmp_path)
    panel.ended = True  # no rank will answer: the thread ends at once
    panel.profile_button.click()
    deadline = time.monotonic() + 20
    while panel.profiling.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    # no rank's steps known (after waiting for them): from the 2 steps past step 0
    assert profile_windows.read_request(RunDir(tmp_path).profile_request) == (1, 5, 2)
    panel.poll()
    assert "profile failed: no rank profiled a step before the call ended" in panel.profile_view.value
    tabs = panel.ranks.tabs
    assert tabs.children[-1] is panel.profile_view and tabs.titles[-1] == "Profile"
    assert tabs.selected_index == len(tabs.children) - 1 == len(panel.ranks.pages)
    assert not panel.profile_button.disabled
    tabs.selected_index = 0
    panel.profiling._html = "again"
    panel.poll()
    assert len(tabs.children) == len(panel.ranks.pages) + 1 and tabs.selected_index == len(panel.ranks.pages)
