"""The warm helper's background preparations (a hook module's `preload`): finished once for the calls whose ranks need
them and kept for every later call; never waited for by a call whose ranks do not need them."""

from __future__ import annotations

import os

import pytest
from faults_common import run_here
from helpers import wait_until

from air_magic.owner import owner

pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]

#: The package the preparation imports. Spelt in two parts: this module's source travels with every call (as a
#: notebook's own modules do), and a call that names the package anywhere has its preparation finished first.
PACKAGE = "slow" + "prep"
#: A module of PACKAGE: its import takes 0.3 s and notes "<pid> m<i>" in `marks` beside the package; the last one
#: also goes on while a file `hold` is there (120 s at most), so that a test can keep the preparation going. It
#: imports a new small module every 0.05 s meanwhile: each import is a moment at which the preparation can give way
#: to a call (it gives way between modules, never inside one), so a call that comes while it is held finds it
#: able to, however late the call comes.
MODULE = """
import importlib, os, pathlib, time
here = pathlib.Path(__file__).parent.parent
time.sleep(0.3)
deadline = time.monotonic() + 120
turn = 0
while {i} == 9 and (here / "hold").exists() and time.monotonic() < deadline:
    name = f"tick_{{os.getpid()}}_{{turn}}"
    (pathlib.Path(__file__).parent / f"{{name}}.py").write_text("")
    importlib.invalidate_caches()
    exec(f"import {{__package__}}.{{name}}")  # an import statement: a function's import never gives way
    turn += 1
    time.sleep(0.05)
with open(here / "marks", "a") as f:
    f.write(f"{{os.getpid()}} m{i}\\n")
"""
HOOK = """
import importlib

PRELOADS = ({package!r},)

def preload(env):
    importlib.import_module({package!r})
    return [{package!r}]
"""


def bare():
    import os

    return os.getpid()


def uses_it(package: str):
    import importlib
    import os

    return (importlib.import_module(package).LOADED_IN, os.getpid())


@pytest.fixture
def slow_preparation(tmp_path, monkeypatch):
    """A helper that has the hook module `delayhook` on its path, whose preparation imports PACKAGE (3 s)."""
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text(
        "import os\n" + "".join(f"from . import m{i}\n" for i in range(10)) + "LOADED_IN = os.getpid()\n"
    )
    for i in range(10):
        (package / f"m{i}.py").write_text(MODULE.format(i=i))
    (tmp_path / "delayhook.py").write_text(HOOK.format(package=PACKAGE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    launcher = owner().launchers.local
    launcher.shutdown()  # the next helper finds the hook module on its path
    try:
        run_here(bare)  # the helper is up
        yield launcher, tmp_path / "marks"
    finally:
        launcher.shutdown()


def test_a_call_whose_ranks_do_not_need_a_preparation_never_waits_for_it(slow_preparation):
    """Calls that do not name what the helper is preparing come back while it is still at it, back to back (the
    preparation is held until they are back: a call that waited for it would wait until m9's 120 s ran out). Held,
    it still reaches a module boundary every 0.05 s: the first call came after it had entered m9 on a busy machine,
    when m9 only slept, and waited those 120 s."""
    launcher, marks = slow_preparation
    hold = marks.parent / "hold"
    hold.touch()
    launcher.prepare_hooks(["delayhook"], {})
    wait_until(marks.exists, 60, "the preparation never began")
    try:
        for _ in range(3):
            run_here(bare)
            assert "m9" not in marks.read_text(), "a call waited for a preparation its ranks do not need"
    finally:
        hold.unlink()
    wait_until(lambda: "m9" in marks.read_text(), 60, "the preparation never ended")  # the preparation, let go, ends


def test_a_preparation_interrupted_by_calls_is_finished_once_for_the_first_call_that_needs_it(slow_preparation):
    """After calls that interrupt it, the first call whose code imports what the preparation brings has it finished
    before its ranks start: every rank of that call and of the next finds it imported in the helper, done once (the
    preparation is held until the interrupting calls are back)."""
    launcher, marks = slow_preparation
    hold = marks.parent / "hold"
    hold.touch()
    launcher.prepare_hooks(["delayhook"], {})
    wait_until(marks.exists, 60, "the preparation never began")
    try:
        run_here(bare)
        run_here(bare)
        assert "m9" not in marks.read_text(), "the calls came back only once the preparation had ended"
    finally:
        hold.unlink()
    helper = launcher.supervisor_pid
    for _ in range(2):
        ranks = run_here(uses_it, PACKAGE).values
        assert [loaded_in for loaded_in, _ in ranks] == [helper, helper], (ranks, helper)
        assert all(pid != helper for _, pid in ranks)
    finished = [line for line in marks.read_text().splitlines() if line.endswith(" m9")]
    assert finished == [f"{helper} m9"], "the preparation did not finish exactly once, in the helper"


def _loaded_once_in(marks, pid: int) -> None:
    lines = marks.read_text().splitlines()
    assert sorted(lines) == sorted(f"{pid} m{i}" for i in range(10)), f"modules loaded again or elsewhere: {lines}"


def test_asking_again_for_a_preparation_under_way_does_not_interrupt_it(slow_preparation):
    """The notebook asks twice (at load, then once its MLflow store is set up): the second request is taken while the
    first runs (held until the request is made), and no module of the preparation is loaded twice."""
    launcher, marks = slow_preparation
    hold = marks.parent / "hold"
    hold.touch()
    launcher.prepare_hooks(["delayhook"], {})
    wait_until(marks.exists, 60, "the preparation never began")
    try:
        launcher.prepare_hooks(["delayhook"], {"SOME_STORE": "1"})
        assert "m9" not in marks.read_text(), "the preparation had ended before it was asked for again"
    finally:
        hold.unlink()
    wait_until(lambda: " m9" in marks.read_text(), 60, "the preparation never ended")
    run_here(bare)  # served after the preparation and its second request
    _loaded_once_in(marks, launcher.supervisor_pid)


def test_a_call_that_needs_the_preparation_under_way_lets_it_finish_instead_of_restarting_it(slow_preparation):
    """A call whose ranks import what the helper is importing right now: the preparation goes on where it is (no
    module loaded twice) and the call's ranks find it imported in the helper."""
    launcher, marks = slow_preparation
    launcher.prepare_hooks(["delayhook"], {})
    wait_until(marks.exists, 60, "the preparation never began")
    helper = launcher.supervisor_pid
    ranks = run_here(uses_it, PACKAGE).values
    assert [loaded_in for loaded_in, _ in ranks] == [helper, helper], (ranks, helper)
    _loaded_once_in(marks, helper)
