"""Debugging a detached call from a kernel that attached it: the call's rank 1 waits at breakpoint() (its owner
process has nobody at its standard input); a second kernel runs `%distributed_attach ID` then
`%distributed_debug --rank 1`, answers `p x` and `c`, and the call finishes with every rank's value. The
attached call's MLflow link is the second kernel's own local UI, which lives as long as that kernel."""

from __future__ import annotations

import time

import pytest

from air_magic.launch.files import debug_channel

pytestmark = pytest.mark.slow

SETUP = """
%load_ext air_magic
from air_magic import distributed

@distributed(2, accelerator_type="CPU", detach=True)
def stops(n):
    import os
    rank = int(os.environ["RANK"])
    x = rank * 10 + n
    if rank == 1:
        breakpoint()
    return x * 2
"""


def test_a_detached_calls_breakpoint_is_debugged_from_a_kernel_that_attached_it(workdir, loaded_kernel, new_kernel):
    """Kernel 1 spawns the call; kernel 2 attaches it, lists the waiting rank, debugs it, and gets its result."""
    loaded_kernel.execute(SETUP).check()
    started = loaded_kernel.execute("h = stops.spawn(5); print('ID', h.id)").check()
    call_id = started.stdout.split("ID ", 1)[1].split()[0]
    run_dir = workdir / "runs" / call_id
    deadline = time.monotonic() + 300
    while 1 not in debug_channel.waiting(run_dir, 2):  # rank 1 waits at its prompt
        assert time.monotonic() < deadline, (run_dir / "owner.log").read_text()
        time.sleep(0.2)
    second = new_kernel(check_children=False)
    second.execute("%load_ext air_magic").check()
    second.execute(f"%distributed_attach {call_id[:24]}").check()
    own = second.execute(  # the panel's MLflow link is this kernel's UI over the call's store, not the owner's
        "from air_magic.calls import record\nfrom air_magic.owner import owner\nfrom air_magic.tracking import ui\n"
        "h = owner().table.running()[-1]\nrec = record.load(h.run_dir)\n"
        "print('OWN', h.link.startswith(ui.local_ui(rec['tracking_uri'], None).direct_url), "
        "h.link != rec['link'])"
    ).check()
    assert "OWN True True" in own.stdout, own.stdout
    listed = second.execute("%distributed_calls").check().stdout
    assert "rank 1 at a breakpoint (%distributed_debug --rank 1)" in listed, listed
    out = second.execute("%distributed_debug --rank 1", answers=["p x", "c"], timeout=120).check()
    assert out.prompts == ["(Pdb rank 1) "] * 2 and "15\n" in out.stdout, (out.prompts, out.stdout)
    got = second.execute(
        f"import air_magic\nprint(air_magic.attach({call_id!r}, show=False).result(timeout=200))", timeout=240
    ).check()
    assert got.stdout.strip().splitlines()[-1] == "[10, 30]", got.stdout
