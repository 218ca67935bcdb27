"""When ranks hang: where every rank is, in the timeout and cancel errors, the logs, the record, and live in the
panel."""

from __future__ import annotations

import ast
import json
import re
import time
from pathlib import Path

import psutil
import pytest
from helpers import reported
from widget_state import WidgetMirror, click, run_cell

pytestmark = pytest.mark.slow

SETUP = """
import json, os, sys, time
from air_magic import distributed
"""

#: Run first in the module's `lab_kernel` (tests/conftest.py): a rank is quiet after 3 s without output.
LAB_KERNEL_SETUP = SETUP + "import air_magic.display.widgets as W\nW.QUIET = 3\n"

#: Rank 0 is stuck in data loading, rank 1 waits for it in a collective: the hang the stacks must explain.
HANG = """
@distributed(num_accelerators=2, accelerator_type="CPU", timeout={timeout}, mlflow=False)
def train():
    import os, time
    import torch.distributed as dist
    dist.init_process_group("gloo")

    def stuck_in_data_loading():
        print("in place", flush=True)
        time.sleep(600)

    def waiting_for_the_slow_rank():
        print("in place", flush=True)
        dist.barrier()

    print("training", flush=True)
    if dist.get_rank() == 0:
        stuck_in_data_loading()
    else:
        waiting_for_the_slow_rank()
"""


def _run_dir(text: str) -> Path:
    return Path(re.findall(r"Logs of every rank are in (\S+?)\.?$", text, re.MULTILINE)[0])


def test_a_timeout_names_the_innermost_user_frame_of_each_rank_and_logs_every_stack(kernel):
    """The DistributedTimeoutError names stuck_in_data_loading on rank 0 and waiting_for_the_slow_rank on rank 1, the
    logs hold every thread's stack (how long the stop takes: bench/faults.py)."""
    kernel.execute(SETUP).check()
    out = kernel.execute(
        HANG.format(timeout=15)
        + """
try:
    train.distributed()
except Exception as exc:
    print("REPORT " + json.dumps({"type": type(exc).__name__, "message": str(exc)}))
""",
        timeout=120,
    ).check()
    report = reported(out.stdout)
    message = report["message"]
    assert report["type"] == "DistributedTimeoutError", message
    assert re.search(r"rank 0: in stuck_in_data_loading \(.+, line \d+\)", message), message
    assert re.search(r"rank 1: in waiting_for_the_slow_rank \(.+, line \d+\)", message), message
    run_dir = _run_dir(message)
    logs = [(run_dir / f"rank-{r}.log").read_text() for r in (0, 1)]
    assert "in stuck_in_data_loading" in logs[0] and "air_magic: stacks of pid" in logs[0]
    assert "in waiting_for_the_slow_rank" in logs[1] and "distributed_c10d.py" in logs[1], logs[1]


def _button(m: WidgetMirror, description: str) -> str:
    return next(cid for cid, s in reversed(m.of_model("ButtonModel")) if s.get("description") == description)


def _stacks_view(m: WidgetMirror) -> str:
    return next((s["value"] for _, s in reversed(m.of_model("HTMLModel")) if "air-magic-stacks" in s["value"]), "")


def test_stacks_during_a_healthy_call_show_where_it_is_and_change_nothing_in_its_results(lab_kernel, tmp_path):
    """Stacks asked for again and again while the ranks exchange tensors: the panel shows their function, the results
    are exactly those of an undisturbed call. The ranks go on until the panel has shown both frames (a marker file),
    so a busy machine that answers slowly is given the time, not a fixed number of steps."""
    clicks: list[float] = []
    views: set[str] = set()
    seen = tmp_path / "seen"

    def ask_for_stacks(m: WidgetMirror) -> None:
        if not m.of_model("TabModel") or not all("summing" in log for log in m.panel()["logs"]):
            return
        view = _stacks_view(m)
        views.add(view)
        if "rank 0: in summing (" in view and "rank 1: in summing (" in view:
            seen.touch()
        if len(clicks) < 20 and (not clicks or time.monotonic() - clicks[-1] > 0.3):
            click(lab_kernel, _button(m, "Stacks"))
            clicks.append(time.monotonic())

    mirror = WidgetMirror()
    out = run_cell(
        lab_kernel,
        f"""
@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def summing(seen):
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print("summing", flush=True)
    total = torch.zeros(1, dtype=torch.float64)
    for i in range(1200):
        step = torch.tensor([float(i + rank), float(i >= 59 and os.path.exists(seen))], dtype=torch.float64)
        dist.all_reduce(step)
        total += step[0]
        if step[1] > 0:  # both ranks leave after the same step
            break
        time.sleep(0.1)
    return total.item(), i + 1
summing.distributed({str(seen)!r})
""",
        mirror,
        timeout=300,
        while_running=ask_for_stacks,
    ).check()
    assert clicks, "the panel never showed both ranks summing"
    assert any("rank 0: in summing (" in v and "rank 1: in summing (" in v for v in views), views
    (total_0, steps_0), (total_1, steps_1) = ast.literal_eval(out.result)
    assert steps_0 == steps_1 >= 60
    assert total_0 == total_1 == steps_0**2  # the sum over the steps i of (i + 0) + (i + 1)


def test_cancel_keeps_every_ranks_stacks_and_a_silent_rank_is_marked_quiet(lab_kernel):
    """While the hang runs, Stacks shows both ranks' frames and the tabs say quiet; Cancel's error names both frames
    and the static record keeps the stacks."""
    seen: dict[str, float] = {}

    def drive(m: WidgetMirror) -> None:
        if "cancel" in seen or not m.of_model("TabModel") or not all("training" in log for log in m.panel()["logs"]):
            return
        view = _stacks_view(m)
        both = "waiting_for_the_slow_rank" in view and "stuck_in_data_loading" in view
        if not both and time.monotonic() - seen.get("stacks", 0) > 1:
            click(lab_kernel, _button(m, "Stacks"))  # again until both ranks have reached where they hang
            seen["stacks"] = time.monotonic()
        elif "cancel" not in seen and both and all("quiet" in title for title in m.panel()["titles"]):
            click(lab_kernel, m.panel()["button"])
            seen["cancel"] = time.monotonic()

    mirror = WidgetMirror()
    out = run_cell(lab_kernel, HANG.format(timeout=90) + "train.distributed()\n", mirror, while_running=drive)
    assert "cancel" in seen, f"never saw both stacks and both quiet tabs: {mirror.panel()['titles']}"
    assert out.ename == "JobCancelledError", out.traceback
    assert re.search(r"rank 0: in stuck_in_data_loading \(", out.traceback), out.traceback
    assert re.search(r"rank 1: in waiting_for_the_slow_rank \(", out.traceback), out.traceback
    record = out.displays[-1]["data"]
    assert "cancelled" in record["text/plain"]
    assert "[rank 0 stacks]" in record["text/plain"] and "stuck_in_data_loading" in record["text/html"]
    assert "waiting_for_the_slow_rank" in record["text/html"]
    # rank 0 is the hung one: once the watch's 30 s pass (a slow machine), its tab may also say so; rank 1 never
    assert mirror.panel()["titles"] in (
        ["rank 0: stopped", "rank 1: stopped"],
        ["rank 0: stopped · ⚠ hung", "rank 1: stopped"],
    )


def test_hot_ranks_answer_in_every_call_and_write_nothing_while_idle(kernel):
    """A hang in the second call of hot ranks is named like a cold one; the first call's logs get no stacks, even when
    the idle ranks are released."""
    kernel.execute(SETUP).check()
    out = kernel.execute(
        HANG.format(timeout=15).replace("mlflow=False", "mlflow=False, keep_alive=60")
        + """
@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False, keep_alive=60)
def where():
    return os.getpid()
first = where.distributed()
try:
    train.distributed()
except Exception as exc:
    print("REPORT " + json.dumps({"type": type(exc).__name__, "message": str(exc)}))
""",
        timeout=120,
    ).check()
    report = reported(out.stdout)
    assert report["type"] == "DistributedTimeoutError", report
    logs = [(_run_dir(report["message"]) / f"rank-{r}.log").read_text() for r in (0, 1)]
    assert "rank 0: in stuck_in_data_loading" in report["message"], (report["message"], logs[0])
    assert "rank 1: in waiting_for_the_slow_rank" in report["message"], (report["message"], logs[1])
    for r in (0, 1):
        log = (_run_dir(report["message"]) / f"rank-{r}.log").read_text()
        assert log.count("air_magic: stacks of pid") == 1, log  # the stop, not again as the stopped pool is released
    out = kernel.execute(
        "%load_ext air_magic\nprint('PIDS', json.dumps(where.distributed()))\n%distributed_release"
    ).check()
    pids = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PIDS "))[5:])
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=15)
    assert not alive
    runs = sorted((Path(kernel.value("os.environ['AIR_MAGIC_RUNS_DIR']").strip("'"))).glob("*-where-*"))
    assert len(runs) == 2
    for run in runs:
        for r in (0, 1):
            assert "air_magic: stacks" not in (run / f"rank-{r}.log").read_text()


def test_a_rank_waiting_on_its_dataloader_worker_shows_both_stacks(kernel):
    """Rank 0 blocks in the DataLoader's queue while its forked worker sleeps in the dataset: the timeout names the
    rank's loop, and the log holds the worker's stack too, each dump whole."""
    kernel.execute(SETUP).check()
    out = kernel.execute(
        """
@distributed(num_accelerators=1, accelerator_type="CPU", timeout=15, mlflow=False)
def load():
    import time, torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return slow_item(i)

    def slow_item(i):
        time.sleep(600)
        return torch.zeros(1)

    def read_batches():
        for batch in DataLoader(Slow(), num_workers=1, multiprocessing_context="fork"):
            print(batch)

    print("loading", flush=True)
    read_batches()
try:
    load.distributed()
except Exception as exc:
    print("REPORT " + json.dumps({"type": type(exc).__name__, "message": str(exc)}))
""",
        timeout=120,
    ).check()
    report = reported(out.stdout)
    assert report["type"] == "DistributedTimeoutError", report
    assert "rank 0: in read_batches (" in report["message"], report["message"]
    from air_magic.launch.files.stack_dumps import parse

    dumps = parse((_run_dir(report["message"]) / "rank-0.log").read_text())
    worker = [d for d in dumps if not d.of_rank]
    assert worker and worker[-1].user_frame().function == "slow_item", [d.text() for d in dumps]


def test_an_interrupt_names_where_each_rank_was(kernel):
    """The kernel's interrupt button stops the hang, and the KeyboardInterrupt carries each rank's innermost user
    frame."""
    kernel.execute(SETUP).check()
    msg_id = kernel.send(HANG.format(timeout=None) + "train.distributed()\n")

    def both_in_place(o) -> bool:  # each rank printed from inside the function it then waits in
        return o.stdout.count("] in place") == 2

    out = kernel.collect(msg_id, timeout=120, interrupt_when=both_in_place)
    assert out.ename == "KeyboardInterrupt", out.traceback
    assert "rank 0: in stuck_in_data_loading (" in out.traceback, out.traceback
    assert "rank 1: in waiting_for_the_slow_rank (" in out.traceback, out.traceback
