"""Sessions: what a session cell builds stays on its ranks for the next cell, through errors and interrupts."""

from __future__ import annotations

import os
import signal
import threading

import psutil
import pytest
from helpers import cell_values as values
from helpers import distributed_cell as cell

#: Every test ends with its sessions' ranks gone (the leak check would see them otherwise).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("releases_hot_ranks")]

#: Two CPU ranks, no MLflow run (one test checks the run).
CPU = "--gpus 2 --accelerator-type CPU --no-mlflow"


def test_names_a_cell_assigns_or_imports_are_there_for_the_next_cell(loaded_kernel):
    """A second --session cell reads what the first assigned and imported, in the same processes."""
    first = cell(
        loaded_kernel, f"--session {CPU}", "import os\nrank = int(os.environ['RANK'])\nseen = [rank]\nos.getpid()"
    )
    pids = values(first)
    second = cell(loaded_kernel, f"--session {CPU}", "seen.append(rank * 10)\n(seen, os.getpid())")
    assert values(second) == [([0, 0], pids[0]), ([1, 10], pids[1])]


def test_session_names_win_over_notebook_globals_and_other_globals_travel_each_time(loaded_kernel):
    """A name the session assigned wins over the notebook's; a notebook global it did not assign travels fresh."""
    loaded_kernel.execute("scale = 2\nshift = 1").check()
    cell(loaded_kernel, f"--session prec {CPU}", "scale = 5\nNone").check()
    loaded_kernel.execute("scale = 3\nshift = 7").check()
    assert values(cell(loaded_kernel, f"--session prec {CPU}", "scale * 10 + shift")) == [57, 57]


def test_an_error_on_every_rank_or_on_one_keeps_the_session(loaded_kernel):
    """User code that raises on all ranks, or on one while the other finishes, leaves the names in place."""
    cell(loaded_kernel, f"--session err {CPU}", "import os\nrank = int(os.environ['RANK'])\ncount = 1").check()
    everywhere = cell(loaded_kernel, f"--session err {CPU}", "count += 1\nraise ValueError('typo')")
    assert everywhere.ename == "ValueError"
    assert "session 'err' was kept" in everywhere.traceback
    on_one = cell(loaded_kernel, f"--session err {CPU}", "count += 1\nif rank == 1:\n    raise KeyError('one')")
    assert on_one.ename == "KeyError" and "rank 1" in on_one.traceback
    assert "session 'err' was kept" in on_one.traceback
    assert values(cell(loaded_kernel, f"--session err {CPU}", "count")) == [3, 3]


def test_an_interrupt_during_a_loop_keeps_what_the_loop_had_done(loaded_kernel):
    """Ctrl-C in a sleep loop raises KeyboardInterrupt on the ranks; the names keep the loop's progress."""
    cell(loaded_kernel, f"--session intr {CPU}", "import time\nsteps = 0").check()
    mid = loaded_kernel.send(
        f"%%distributed --session intr {CPU}\n"
        "for i in range(600):\n    steps += 1\n    print('step', steps, flush=True)\n    time.sleep(0.05)"
    )
    out = loaded_kernel.collect(
        mid, interrupt_when=lambda out: "[rank 0] step 5\n" in out.stdout and "[rank 1] step 5\n" in out.stdout
    )
    assert out.ename == "KeyboardInterrupt"
    assert "session 'intr' was kept" in out.traceback
    steps = values(cell(loaded_kernel, f"--session intr {CPU}", "steps"))
    assert all(5 <= s < 600 for s in steps), steps  # each rank kept the steps it had made


def test_an_interrupt_that_comes_while_a_rank_still_loads_the_call_is_not_lost(loaded_kernel):
    """Ctrl-C while one rank still unpickles the cell's values (long on a busy machine): that rank raises
    KeyboardInterrupt as its code would start, so the call comes back and the session is kept, instead of the rank
    running the whole cell and the session ending for a rank that "did not come back"."""
    loaded_kernel.execute(  # no import in the notebook: later tests expect names such as `os` to be undefined there
        "def slow_load():\n"
        "    import os, time\n"
        "    if os.environ['RANK'] == '1':\n"
        "        print('loading', flush=True)\n"
        "        time.sleep(3)\n"
        "    return 0\n"
        "class SlowToLoad:\n"
        "    def __reduce__(self):\n"
        "        return (slow_load, ())\n"
        "slow = SlowToLoad()"
    ).check()
    cell(loaded_kernel, f"--session early {CPU}", "import time\nsteps = 0").check()
    mid = loaded_kernel.send(
        f"%%distributed --session early {CPU}\n"
        "slow\nfor i in range(600):\n    steps += 1\n    print('step', steps, flush=True)\n    time.sleep(0.05)"
    )
    out = loaded_kernel.collect(mid, interrupt_when=lambda out: "[rank 1] loading" in out.stdout)
    assert out.ename == "KeyboardInterrupt", out.traceback
    assert "session 'early' was kept" in out.traceback
    assert all(s < 600 for s in values(cell(loaded_kernel, f"--session early {CPU}", "steps")))
    loaded_kernel.execute("del slow, SlowToLoad, slow_load").check()


def test_a_rank_stuck_in_all_reduce_after_the_other_raised_ends_the_session_and_leaves_nothing(loaded_kernel):
    """The stuck rank does not come back from KeyboardInterrupt: its stack is written, the world is stopped,
    the session ends with a note, and no rank process is left."""
    first = cell(loaded_kernel, f"--session stuck {CPU}", "import os\nos.getpid()")
    pids = values(first)
    out = cell(
        loaded_kernel,
        f"--session stuck {CPU}",
        "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "if dist.get_rank() == 0:\n    raise RuntimeError('rank 0 fails')\ndist.all_reduce(torch.ones(1))",
    )
    assert out.ename == "RuntimeError" and "rank 0 fails" in out.traceback
    assert "session 'stuck' ended" in out.traceback and "did not come back" in out.traceback
    assert "stacks of pid" in out.stdout  # written before the stop, into the stuck rank's log
    _gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=15)
    assert not alive
    after = cell(loaded_kernel, f"--session stuck {CPU}", "os")
    assert after.ename == "NameError"
    assert "session 'stuck'" in after.traceback and "held 'os'" in after.traceback


def test_a_rank_that_ignores_sigint_is_stopped(loaded_kernel):
    """A rank whose code ignores SIGINT is stopped after the interrupt's grace, and the session ends."""
    cell(loaded_kernel, f"--session deaf {CPU}", "import signal, time\nx = 1").check()
    mid = loaded_kernel.send(
        f"%%distributed --session deaf {CPU}\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('deaf', flush=True)\ntime.sleep(120)"
    )
    # both ranks ignore SIGINT once both printed (the cell's header names the session 'deaf' too: not a rank's line)
    out = loaded_kernel.collect(mid, interrupt_when=lambda out: out.stdout.count("] deaf\n") == 2)
    assert out.ename == "KeyboardInterrupt"
    assert "session 'deaf' ended" in out.traceback, (out.stdout, out.traceback)
    assert "session 'deaf'" not in loaded_kernel.execute("%distributed_session").stdout


def test_a_function_in_a_session_reads_its_globals_there_first_and_takes_refs(loaded_kernel):
    """@distributed(session=...) resolves free globals in the session first; Ref passes each rank its object."""
    loaded_kernel.execute(
        "from air_magic import Ref, distributed\n"
        "offset = 1000\n"
        "@distributed(num_accelerators=2, accelerator_type='CPU', mlflow=False, session='fn')\n"
        "def combine(model, scale):\n"
        "    return model['w'] * scale + offset + bonus\n"
        "bonus = 1"
    ).check()
    cell(
        loaded_kernel, f"--session fn {CPU}", "import os\nmodel = {'w': int(os.environ['RANK']) + 1}\noffset = 10"
    ).check()
    result = loaded_kernel.execute("combine.distributed(Ref('model'), 2)")
    assert values(result) == [2 + 10 + 1, 4 + 10 + 1]
    missing = loaded_kernel.execute("combine.distributed(Ref('nope'), 2)")
    assert missing.ename == "NameError" and "nope" in missing.traceback


def test_ranks_runs_a_cell_on_some_ranks_only_and_needs_a_session(loaded_kernel):
    """--ranks 0 runs on rank 0 alone and returns its value; without --session it is a usage error."""
    cell(loaded_kernel, f"--session some {CPU}", "import os\nrank = int(os.environ['RANK'])\nhits = 0").check()
    assert values(cell(loaded_kernel, f"--session some --ranks 0 {CPU}", "hits += 1\n(rank, hits)")) == [(0, 1)]
    assert values(cell(loaded_kernel, f"--session some {CPU}", "hits")) == [1, 0]
    refused = cell(loaded_kernel, f"--ranks 0 {CPU}", "1")
    assert "--ranks" in refused.stderr + refused.traceback and "--session" in refused.stderr + refused.traceback


def test_push_and_pull_move_values_and_pushed_names_win(loaded_kernel):
    """%distributed_push sends notebook values in; %distributed_pull brings a list by rank, or one rank's value."""
    cell(loaded_kernel, f"--session pp {CPU}", "import os\nrank = int(os.environ['RANK'])").check()
    loaded_kernel.execute("lr = 0.5\n%distributed_push --session pp lr").check()
    loaded_kernel.execute("lr = 99").check()
    cell(loaded_kernel, f"--session pp {CPU}", "loss = [lr * (rank + 1)]").check()
    loaded_kernel.execute(
        "every = %distributed_pull --session pp loss\none = %distributed_pull --session pp --rank 1 loss"
    ).check()
    assert loaded_kernel.value("every") == "[[0.5], [1.0]]"
    assert loaded_kernel.value("one") == "[1.0]"


def test_an_unpicklable_last_expression_comes_back_as_a_placeholder(loaded_kernel):
    """The cell succeeds; the notebook gets a placeholder with the repr, and the object stays on the rank as _."""
    out = cell(loaded_kernel, f"--session ph {CPU}", "import threading\nthreading.Lock()").check()
    assert "kept on rank 0 as _" in (out.result or "") and "lock" in (out.result or "")
    assert values(cell(loaded_kernel, f"--session ph {CPU}", "type(_).__name__")) == ["lock", "lock"]


def test_a_rank_that_dies_ends_the_session_and_the_next_name_error_says_so(loaded_kernel):
    """A rank killed between cells ends the session; the next cell's NameError names the ranks, time and cause."""
    pids = values(cell(loaded_kernel, f"--session die {CPU}", "import os\nweights = [1, 2]\nos.getpid()"))
    psutil.Process(pids[1]).kill()
    psutil.wait_procs([psutil.Process(pids[0])], timeout=15)
    out = cell(loaded_kernel, f"--session die {CPU}", "weights")
    assert out.ename == "NameError"
    assert "session 'die'" in out.traceback + out.stderr and "held 'weights'" in out.traceback
    assert "rank 1" in out.traceback + out.stderr


def test_distributed_session_lists_ends_and_resets(loaded_kernel):
    """%distributed_session lists ranks, pids and names; --reset empties them; --end ends the ranks; another
    world under a live session's name is refused with the way out."""
    pids = values(
        cell(loaded_kernel, f"--session listed {CPU}", "import os, torch\nt = torch.zeros(1000)\nos.getpid()")
    )
    listing = loaded_kernel.execute("%distributed_session").check().stdout
    assert "session 'listed'" in listing and str(pids[0]) in listing and "t: Tensor[1000] float32" in listing
    other = cell(loaded_kernel, "--session listed --gpus 3 --accelerator-type CPU --no-mlflow", "1")
    assert other.ename == "ConfigurationError" and "%distributed_session --end listed" in other.traceback
    loaded_kernel.execute("%distributed_session --reset listed").check()
    assert values(cell(loaded_kernel, f"--session listed {CPU}", "'t' in globals()")) == [False, False]
    ended = loaded_kernel.execute("%distributed_session --end listed").check().stdout
    assert "session 'listed'" in ended and "ended" in ended
    psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=15)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


def test_a_session_cell_is_an_mlflow_run(loaded_kernel):
    """Every session cell is still an MLflow run that its ranks log to."""
    first = cell(loaded_kernel, "--session logged --gpus 2 --accelerator-type CPU", "import mlflow\nk = 1")
    assert first.error is None and "MLflow run: " in first.stdout
    second = cell(loaded_kernel, "--session logged --gpus 2 --accelerator-type CPU", "mlflow.log_metric('k', k)")
    assert second.error is None and "MLflow run: " in second.stdout


def test_a_notebook_object_of_a_name_the_session_holds_is_never_sent(loaded_kernel):
    """A cell or a session function reading a name the session holds sends no copy of the notebook's object."""
    loaded_kernel.execute(
        "import torch\nfrom air_magic import distributed\nbig = torch.zeros(8_000_000)\n"
        "@distributed(num_accelerators=2, accelerator_type='CPU', mlflow=False, session='held')\n"
        "def total():\n    return float(big.sum())"
    ).check()
    cell(loaded_kernel, f"--session held {CPU}", "import torch\nbig = torch.ones(10)").check()
    for code in (f"%%distributed --session held {CPU}\nfloat(big.sum())", "total.distributed()"):
        out = loaded_kernel.execute(code).check()
        assert eval(out.result) == [10.0, 10.0]
        run_dir = out.stdout.split("logs in ", 1)[1].split()[0]
        payload = loaded_kernel.value(f"__import__('os').path.getsize({run_dir!r} + '/payload.pkl')")
        assert int(payload) < 1_000_000, f"{code!r} sent {payload} bytes"


def test_a_second_interrupt_stops_the_session_at_once(loaded_kernel):
    """While the ranks are being asked to come back, a second Ctrl-C stops them without waiting for them."""
    cell(loaded_kernel, f"--session twice {CPU}", "import signal, time").check()
    mid = loaded_kernel.send(
        f"%%distributed --session twice {CPU}\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('deaf', flush=True)\ntime.sleep(120)"
    )

    def interrupt_twice(out) -> bool:
        if out.stdout.count("deaf") < 2:
            return False
        # the second, while the first is being waited on (a signal, as Jupyter sends it: no client call off-thread)
        threading.Timer(1.0, os.kill, (loaded_kernel.pid, signal.SIGINT)).start()
        return True

    out = loaded_kernel.collect(mid, timeout=60, interrupt_when=interrupt_twice)
    assert out.ename == "KeyboardInterrupt"
    assert "session 'twice' ended" in out.traceback and "(interrupted)" in out.traceback
    assert "did not come back" not in out.traceback


def test_a_process_a_session_rank_started_stays_with_the_session_and_ends_with_it(loaded_kernel):
    """A child a rank keeps (a compile worker, a DataLoader's persistent worker) neither ends the session when the
    cell ends nor outlives the session."""
    first = cell(
        loaded_kernel,
        f"--session kids {CPU}",
        "import os, subprocess\nkid = subprocess.Popen(['sleep', '120'])\n(os.getpid(), kid.pid)",
    )
    pids = values(first)
    again = cell(loaded_kernel, f"--session kids {CPU}", "(os.getpid(), kid.pid, kid.poll())")
    assert values(again) == [(rank, kid, None) for rank, kid in pids]
    loaded_kernel.execute("%distributed_session --end kids").check()
    procs = [psutil.Process(pid) for pair in pids for pid in pair if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_a_session_call_that_restarts_goes_on_in_the_new_ranks(loaded_kernel):
    """With max_restarts, a failed attempt ends the session's old world (said once); the attempt that succeeds is
    the session from then on: the next cell reads what it assigned, and the table lists its ranks."""
    cell(loaded_kernel, f"--session again {CPU}", "import os\nbefore = 1").check()
    body = (
        "import os\nif os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['RANK'] == '1':\n"
        "    raise RuntimeError('first attempt fails')\nafter = os.getpid()\nafter"
    )
    restarted = cell(loaded_kernel, f"--session again --max-restarts 1 {CPU}", body)
    assert restarted.error is None, restarted.traceback
    said = restarted.stderr
    assert "session 'again'" in said and "ended at" in said and "a restart (max_restarts)" in said, said
    pids = values(restarted)
    assert values(cell(loaded_kernel, f"--session again {CPU}", "(after, 'before' in globals())")) == [
        (pids[0], False),
        (pids[1], False),
    ]
    listing = loaded_kernel.execute("%distributed_session").check().stdout
    assert "session 'again'" in listing and str(pids[1]) in listing, listing


def test_a_session_call_whose_restart_fails_with_a_user_error_is_kept_in_the_new_ranks(loaded_kernel):
    """With max_restarts, when the attempt after the restart also fails with a user error, that attempt's ranks are
    the session (a user error keeps a session): the error says so, and the next cell runs in them and reads what the
    failed cell assigned there, not what the ranks before the restart held."""
    cell(loaded_kernel, f"--session kept {CPU}", "import os\nbefore = 1").check()
    body = (
        "import os\nafter = os.getpid()\nprint('PID', os.environ['RANK'], after, flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ValueError('attempt ' + os.environ['TORCHELASTIC_RESTART_COUNT'] + ' fails')\n"
    )
    failed = cell(loaded_kernel, f"--session kept --max-restarts 1 {CPU}", body)
    assert failed.error is not None and "attempt 1 fails" in failed.traceback, failed.traceback
    assert "was kept in the ranks the restart started" in failed.traceback, failed.traceback
    last = {}
    for line in failed.stdout.splitlines():
        if "PID " in line:
            rank, pid = line.split("PID ", 1)[1].split()[:2]
            last[int(rank)] = int(pid)  # the last attempt's line comes last
    got = values(cell(loaded_kernel, f"--session kept {CPU}", "import os\n(after, os.getpid(), 'before' in globals())"))
    assert got == [(last[0], last[0], False), (last[1], last[1], False)], (got, last)
    listing = loaded_kernel.execute("%distributed_session").check().stdout
    assert "session 'kept'" in listing and str(last[1]) in listing, listing
