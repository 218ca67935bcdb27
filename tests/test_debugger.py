"""Debugging ranks from the cell: breakpoint() prompts through the kernel's input requests, `q`, and a session's
post-mortem with %distributed_debug."""

from __future__ import annotations

import pytest
from helpers import cell_values as values
from helpers import wait_until

pytestmark = pytest.mark.slow

#: Two CPU ranks, no MLflow run.
CPU = "--gpus 2 --accelerator-type CPU --no-mlflow"

STEPPED = """
from air_magic import distributed

@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def stepped(n):
    import os
    rank = int(os.environ["RANK"])
    x = rank * 10 + n
    if rank == 1:
        breakpoint()
    y = x * 2  # the line after the breakpoint
    return y
"""


@pytest.fixture(scope="module")
def debug_kernel(kernel):
    """The module's kernel with air_magic loaded and a function that stops at breakpoint() on rank 1."""
    kernel.execute("%load_ext air_magic").check()
    kernel.execute(STEPPED).check()
    return kernel


def test_a_breakpoint_on_rank_1_prompts_in_the_cell_and_steps_and_continues(debug_kernel):
    """`p` shows a local, `l` the function's lines, `n` steps, and `c` lets the call return every rank's value."""
    out = debug_kernel.execute("stepped.distributed(1)", answers=["p x", "l", "n", "p y", "c"], timeout=180)
    out.check()
    assert out.prompts == ["(Pdb rank 1) "] * 5
    assert "11\n" in out.stdout  # p x
    assert "the line after the breakpoint" in out.stdout  # l shows the notebook's own source
    assert "22\n" in out.stdout  # p y, after n
    assert eval(out.result or "None") == [2, 22]


def test_q_at_the_prompt_ends_the_call_with_an_error_naming_the_rank(debug_kernel):
    """`q` stops every rank and raises DebuggerQuit naming rank 1; the next call runs as usual."""
    out = debug_kernel.execute("stepped.distributed(1)", answers=["q"], timeout=180)
    assert out.ename == "DebuggerQuit", out.traceback
    assert "rank 1" in out.traceback
    again = debug_kernel.execute("stepped.distributed(2)", answers=["c"], timeout=180)
    assert eval(again.check().result or "None") == [4, 24]


def test_a_cell_stops_at_torch_breakpoint_and_at_pdb_set_trace_on_two_ranks_one_after_the_other(debug_kernel):
    """torch.distributed.breakpoint(rank=1) and pdb.set_trace() on both ranks: every prompt names its rank, and the
    cell's own lines show."""
    cell = (
        f"%%distributed {CPU}\n"
        "import os, pdb, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "dist.breakpoint(rank=1)\n"
        "pdb.set_trace()\n"
        "rank * 100  # the cell's last line\n"
    )
    out = debug_kernel.execute(cell, answers=["u", "p rank", "c", "l", "c", "c"], timeout=180)
    out.check()
    assert out.prompts[:3] == ["(Pdb rank 1) "] * 3
    assert len(out.prompts) == 6 and set(out.prompts[3:]) == {"(Pdb rank 0) ", "(Pdb rank 1) "}
    assert "the cell's last line" in out.stdout
    assert eval(out.result or "None") == [0, 100]


def test_a_background_calls_waiting_rank_is_attached_to_from_another_cell(debug_kernel):
    """The rank of a spawned call waits at its prompt (its wait file says so); %distributed_debug attaches to it."""
    debug_kernel.execute(
        "import time\nfrom air_magic.launch.files import debug_channel\nh = stepped.spawn(5)\n"
        "while not debug_channel.waiting(h.run_dir, 2) and not h.done():\n    time.sleep(0.1)\n"
        "print(sorted(debug_channel.waiting(h.run_dir, 2)))",
        timeout=180,
    ).check()
    listed = debug_kernel.execute("%distributed_calls").check()
    assert "rank 1 at a breakpoint (%distributed_debug --rank 1)" in listed.stdout, listed.stdout
    out = debug_kernel.execute("%distributed_debug --rank 1", answers=["p x", "c"], timeout=60).check()
    assert out.prompts == ["(Pdb rank 1) "] * 2 and "15\n" in out.stdout
    assert debug_kernel.execute("print(h.result(timeout=120))", timeout=180).check().stdout.strip() == "[10, 30]"


def test_without_input_requests_a_breakpoint_says_so_and_the_call_goes_on(debug_kernel):
    """A frontend that cannot answer input (nbclient) gets a message and the rank continues."""
    out = debug_kernel.execute("stepped.distributed(1)", timeout=180).check()
    assert "cannot answer input requests" in out.stdout
    assert eval(out.result or "None") == [2, 22]


def test_a_post_mortem_opens_on_the_failing_frame_of_a_session_rank(debug_kernel):
    """After a session cell raised on rank 1, %distributed_debug shows that frame's local; the next cell lets go."""
    debug_kernel.execute(
        f"%%distributed --session pm {CPU}\n"
        "import os\n"
        "rank = int(os.environ['RANK'])\n"
        "def fails(secret):\n"
        "    if rank == 1:\n"
        "        raise ValueError('bad step')\n"
        "    return secret\n"
        "None"
    ).check()
    failed = debug_kernel.execute(f"%%distributed --session pm {CPU}\nfails(41 + rank)")
    assert failed.ename == "ValueError" and "session 'pm' was kept" in failed.traceback
    out = debug_kernel.execute("%distributed_debug --session pm", answers=["p secret", "w", "c"], timeout=120)
    out.check()
    assert out.prompts == ["(Pdb rank 1) "] * 3
    assert "42\n" in out.stdout and "bad step" in out.stdout
    values(debug_kernel.execute(f"%%distributed --session pm {CPU}\nrank"))
    gone = debug_kernel.execute("%distributed_debug --session pm", answers=[])
    assert "UsageError" in gone.stderr and "keeps an error" in gone.stderr
    debug_kernel.execute("%distributed_release").check()


def test_an_interrupt_at_the_prompt_of_a_session_rank_keeps_the_session(debug_kernel, tmp_path):
    """The kernel's interrupt while rank 1 waits at its prompt (and rank 0 has run the cell) raises
    KeyboardInterrupt; the session keeps its names, with what the cell did on both ranks."""
    start = "import os\nrank = int(os.environ['RANK'])\nn = 1"
    debug_kernel.execute(f"%%distributed --session intr {CPU}\n{start}").check()
    done = tmp_path / "rank-0-ran"
    cell = f"n += 1\nif rank == 0:\n    open({str(done)!r}, 'w').close()\nif rank == 1:\n    breakpoint()\nn"
    mid = debug_kernel.kc.execute(f"%%distributed --session intr {CPU}\n{cell}", allow_stdin=True)
    assert debug_kernel.kc.get_stdin_msg(timeout=120)["content"]["prompt"] == "(Pdb rank 1) "
    wait_until(done.exists, 120, "rank 0 never ran the cell")  # a rank still loading it would keep the interrupt
    debug_kernel.interrupt()
    out = debug_kernel.collect(mid)
    assert out.ename == "KeyboardInterrupt" and "session 'intr' was kept" in out.traceback
    assert values(debug_kernel.execute(f"%%distributed --session intr {CPU}\nn")) == [2, 2]
    debug_kernel.execute("%distributed_release").check()


def test_outside_a_session_distributed_debug_says_how_to_get_a_post_mortem(debug_kernel):
    """No live session: the error names both ways, a session or breakpoint()."""
    out = debug_kernel.execute("%distributed_debug --session nothing_here", answers=[])
    assert "UsageError" in out.stderr and not out.prompts
    assert "--session" in out.stderr and "breakpoint()" in out.stderr
