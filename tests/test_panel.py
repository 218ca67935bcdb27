"""The live panel (SPEC §3) in a real kernel, the Cancel route, floods, and the plain-text display."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import FLOOD_MB, CellResult, execute_headless, process_env
from widget_state import WidgetMirror, click, run_cell

#: Real kernels and processes: seconds each.
pytestmark = pytest.mark.slow

SETUP = """
import os, sys, time
from air_magic import distributed
"""
#: Run first in the module's `lab_kernel` (tests/conftest.py).
LAB_KERNEL_SETUP = SETUP


def test_panel_shows_a_tab_per_rank_with_its_own_output_and_final_state(lab_kernel):
    """Each rank's stdout and stderr land in its own tab, titled with its state, and nothing floods the cell's
    stdout."""
    mirror = WidgetMirror()
    out = run_cell(
        lab_kernel,
        """
@distributed(num_accelerators=2, accelerator_type="CPU")
def hello():
    import os, sys
    r = int(os.environ["RANK"])
    print(f"hello from rank {r}")
    print(f"warning on rank {r}", file=sys.stderr)
    return r * 10
hello.distributed()
""",
        mirror,
    ).check()
    assert out.result == "[0, 10]"
    panel = mirror.panel()
    assert panel["titles"] == ["rank 0: done", "rank 1: done"]
    for rank, log in enumerate(panel["logs"]):
        assert f"hello from rank {rank}" in log and f"warning on rank {rank}" in log
        assert f"hello from rank {1 - rank}" not in log
    assert "finished" in panel["status"] and "2 rank(s)" in panel["status"]
    assert 'MLflow <a href="' in panel["link"] and "/runs/" in panel["link"], panel["link"]
    assert panel["button_state"]["disabled"] is True
    assert "[rank 0]" not in out.stdout, "the panel replaces the plain lines"
    record = out.displays[-1]
    assert set(record["data"]) == {"text/html", "text/plain"}, "the ended panel is replaced by a static record"
    assert record["transient"]["display_id"] == out.displays[0]["transient"]["display_id"]
    for rank in (0, 1):
        assert f"hello from rank {rank}" in record["data"]["text/html"]
        assert f"[rank {rank}] warning on rank {rank}" in record["data"]["text/plain"]
    assert "finished" in record["data"]["text/plain"] and "/runs/" in record["data"]["text/plain"]


def _mib(text: str) -> float:
    """'412 MiB' or '1.28 GiB' as MiB."""
    number, unit = text.split()
    return float(number) * (1024 if unit == "GiB" else 1)


PEAK = re.compile(r"rank (\d): done · peak memory ([\d.]+ [MG]iB)")


@pytest.mark.slow
def test_each_rank_s_tab_shows_what_it_uses_live_and_the_record_keeps_each_peak(lab_kernel):
    """While the call runs each tab shows its rank's CPU % and memory, the header the ranks' memory; the record
    keeps each rank's peak, rank 0's at least the 300 MiB it allocated more than rank 1."""
    mirror = WidgetMirror()
    seen: dict[str, list[str]] = {"usages": [], "status": []}

    def watch(m: WidgetMirror) -> None:
        if m.of_model("TabModel"):
            panel = m.panel()
            if all("CPU" in u for u in panel["usages"]):
                seen["usages"] = panel["usages"]
                seen["status"].append(panel["status"])

    out = run_cell(
        lab_kernel,
        """
@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def holds():
    import os, time
    block = bytearray(300 * 2**20 if os.environ["RANK"] == "0" else 1)
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(4)
    return len(block)
holds.distributed()
""",
        mirror,
        while_running=watch,
    ).check()
    assert out.result == f"[{300 * 2**20}, 1]"
    assert seen["usages"], "no usage line was shown while the ranks ran"
    for usage in seen["usages"]:
        assert re.search(r"CPU \d+% · memory [\d.]+ [MG]iB", usage), usage
    assert any("air-magic-resources" in s and "memory" in s for s in seen["status"])
    record = out.displays[-1]["data"]
    peaks = {int(r): _mib(v) for r, v in PEAK.findall(record["text/html"])}
    assert set(peaks) == {0, 1}, record["text/html"][:2000]
    assert peaks[0] >= peaks[1] + 280, peaks
    assert {int(r): _mib(v) for r, v in PEAK.findall(record["text/plain"])} == peaks


def test_cancel_click_while_the_cell_runs_stops_every_process_and_the_kernel_stays_usable(lab_kernel):
    """A Button click sent while the cell is busy ends every worker and child within 5 s with a one-line 'cancelled'
    error."""
    mirror = WidgetMirror()
    seen: dict[str, float] = {}

    def click_once_running(m: WidgetMirror) -> None:
        if "clicked" in seen or not m.of_model("TabModel"):
            return
        panel = m.panel()
        if all("pid " in log for log in panel["logs"]):
            click(lab_kernel, panel["button"])
            seen["clicked"] = time.monotonic()

    out = run_cell(
        lab_kernel,
        """
@distributed(num_accelerators=2, accelerator_type="CPU")
def forever():
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"pid {os.getpid()} child {child.pid}", flush=True)
    while True:
        time.sleep(0.2)
forever.distributed()
""",
        mirror,
        while_running=click_once_running,
    )
    assert "clicked" in seen, "the panel never showed both ranks running"
    assert out.ename == "JobCancelledError", out.traceback
    assert len(out.error["traceback"]) == 1 and "was cancelled" in out.traceback
    panel = mirror.panel()
    assert panel["titles"] == ["rank 0: stopped", "rank 1: stopped"]
    assert "cancelled" in panel["status"]
    assert "cancelled" in out.displays[-1]["data"]["text/plain"]
    assert "rank 0: stopped" in out.displays[-1]["data"]["text/html"]
    pids = [int(pid) for log in panel["logs"] for pid in re.findall(r"pid (\d+) child (\d+)", log)[0]]
    assert len(pids) == 4
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert run_cell(lab_kernel, "21 * 2", WidgetMirror()).check().result == "42"


def test_a_timeout_and_an_interrupt_leave_a_record_saying_so(lab_kernel):
    """A call stopped by its timeout, or by a kernel interrupt, is replaced by a record that says how it ended."""
    out = run_cell(
        lab_kernel,
        """
@distributed(num_accelerators=2, accelerator_type="CPU", timeout=2, mlflow=False)
def sleepy():
    import time
    print("going to sleep", flush=True)
    time.sleep(60)
sleepy.distributed()
""",
        WidgetMirror(),
    )
    assert out.ename == "DistributedTimeoutError"
    record = out.displays[-1]["data"]
    assert "timed out" in record["text/plain"] and "going to sleep" in record["text/html"]

    mirror = WidgetMirror()
    seen: dict[str, bool] = {}

    def interrupt_once_running(m: WidgetMirror) -> None:
        if not seen and m.of_model("TabModel") and all("going" in log for log in m.panel()["logs"]):
            seen["interrupted"] = True
            lab_kernel.interrupt()

    out = run_cell(
        lab_kernel, "sleepy.with_overrides(timeout=None).distributed()", mirror, while_running=interrupt_once_running
    )
    assert seen and out.ename == "KeyboardInterrupt"
    record = out.displays[-1]["data"]
    assert "interrupted" in record["text/plain"] and "rank 1: stopped" in record["text/html"]


def test_a_call_that_never_starts_leaves_no_starting_line(lab_kernel):
    """The line shown the moment a call begins is emptied when the call fails before its panel (an argument that cannot
    be pickled)."""
    out = run_cell(
        lab_kernel,
        """
import threading
@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def takes(lock):
    return 1
takes.distributed(threading.Lock())
""",
        WidgetMirror(),
    )
    assert out.ename == "SerializationError"
    first, last = out.displays[0], out.displays[-1]
    assert "starting" in first["data"]["text/plain"]
    assert last["transient"]["display_id"] == first["transient"]["display_id"] and last["data"] == {"text/plain": ""}


class StatusMirror(WidgetMirror):
    """A WidgetMirror that also keeps every status message: (execution_state, parent msg_type, parent msg_id)."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: list[tuple[str, str, str]] = []

    def feed(self, msg: dict) -> None:
        super().feed(msg)
        if msg["msg_type"] == "status":
            parent = msg["parent_header"]
            self.statuses.append((msg["content"]["execution_state"], parent.get("msg_type"), parent.get("msg_id")))


def test_the_kernel_stays_busy_while_jupyterlab_talks_to_widgets_on_its_own_subshell(lab_kernel):
    """As JupyterLab does, a subshell is created and a tab change and Cancel are sent on it mid-call: every idle those
    publish is followed at once by busy for the cell, and the click still cancels the call."""
    mirror = StatusMirror()
    kc = lab_kernel.kc
    sent: dict[str, str] = {}

    def act(m: WidgetMirror) -> None:
        if "clicked" in sent or not m.of_model("TabModel") or not all("pid " in log for log in m.panel()["logs"]):
            return
        request = kc.session.msg("create_subshell_request", {})
        kc.control_channel.send(request)
        reply = kc.control_channel.get_msg(timeout=30)
        subshell = reply["content"]["subshell_id"]
        ((tab_id, _),) = m.of_model("TabModel")[-1:]
        for data in (
            {"method": "update", "state": {"selected_index": 1}, "buffer_paths": []},
            {"method": "custom", "content": {"event": "click"}},
        ):
            comm_id = tab_id if data["method"] == "update" else m.panel()["button"]
            msg = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
            msg["header"]["subshell_id"] = subshell
            kc.shell_channel.send(msg)
        sent["clicked"] = subshell

    msg_id = lab_kernel.send(
        """
@distributed(num_accelerators=2, accelerator_type="CPU")
def forever():
    import os, time
    print(f"pid {os.getpid()}", flush=True)
    while True:
        time.sleep(0.2)
forever.distributed()
"""
    )
    out = CellResult()
    deadline = time.monotonic() + 180
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        mirror.feed(msg)
        if msg["parent_header"].get("msg_id") == msg_id:
            out.add(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        act(mirror)
    assert "clicked" in sent and out.ename == "JobCancelledError", out.traceback
    mine = [i for i, s in enumerate(mirror.statuses) if s[2] == msg_id]
    during = mirror.statuses[mine[0] : mine[-1] + 1]
    assert during[0] == ("busy", "execute_request", msg_id) and during[-1] == ("idle", "execute_request", msg_id)
    others = [i for i, s in enumerate(during[:-1]) if s[0] == "idle"]
    assert others, "the subshell's requests published their own idle"
    for i in others:
        assert during[i][2] != msg_id and during[i + 1] == ("busy", "execute_request", msg_id), during
    assert run_cell(lab_kernel, "21 * 2", WidgetMirror()).check().result == "42"


def test_a_flood_keeps_a_bounded_tail_and_the_full_log_on_disk(lab_kernel):
    """A rank printing FLOOD_MB megabytes reaches the browser as small bounded updates (a tenth of the flood at most)
    that say how many lines were left out; the log on disk has it all."""
    mirror = WidgetMirror()
    out = run_cell(
        lab_kernel,
        f"""
@distributed(num_accelerators=2, accelerator_type="CPU")
def flood():
    import os, sys
    if os.environ["RANK"] == "0":
        block = "".join(f"line {{i:07d}} " + "x" * 86 + "\\n" for i in range(10_000))  # 1 MB
        for _ in range({FLOOD_MB}):
            sys.stdout.write(block)
        print("flood done")
    else:
        print("quiet rank")
    return os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"]
run_dir = flood.distributed()[0]
""",
        mirror,
        timeout=300,
    ).check()
    panel = mirror.panel()
    assert panel["titles"] == ["rank 0: done", "rank 1: done"]
    flood_tab, quiet_tab = panel["logs"]
    assert "flood done" in flood_tab and "quiet rank" in quiet_tab
    assert "earlier line(s) not shown" in flood_tab and "rank-0.log" in flood_tab
    shown = int(flood_tab.split("…")[1].split("earlier")[0].replace(",", ""))
    kept = flood_tab.count("\nline ") + flood_tab.count(">line ")
    assert shown + kept + 1 == FLOOD_MB * 10_000 + 1  # every line is either shown or counted
    assert len(flood_tab) < 64 * 1024
    assert mirror.update_bytes < FLOOD_MB * 1_000_000 / 10, "the browser got a bounded stream, not the flood"
    run_dir = run_cell(lab_kernel, "run_dir", WidgetMirror()).check().result.strip("'")
    assert os.path.getsize(Path(run_dir) / "rank-0.log") >= FLOOD_MB * 1_000_000
    assert "[rank 0]" not in out.stdout


HEADLESS_CELLS = [
    "from air_magic import distributed",
    """@distributed(num_accelerators=2, accelerator_type="CPU")
def train():
    import os, mlflow
    r = int(os.environ["RANK"])
    for step in range(100):
        print(f"step {step} on rank {r}")
        mlflow.log_metric("loss", 1.0 / (step + 1) + r, step=step)
    mlflow.log_metrics({"acc": 0.5 + r / 10, "lr": 0.01}, step=99)
    return r
train.distributed()""",
    """@distributed(num_accelerators=2, accelerator_type="CPU")
def broken():
    import os
    print("about to fail on rank", os.environ["RANK"])
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 gave up")
broken.distributed()""",
    """@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def untracked():
    import os, sys
    print("untracked rank", os.environ["RANK"], "mlflow imported:", "mlflow" in sys.modules)
untracked.distributed()""",
]


def test_a_notebook_executed_headless_keeps_a_static_record_that_nbconvert_shows(tmp_path):
    """Run headless with the panel, saved and converted: every call's status, link, ranks' last lines and charts stay,
    with no widget state and no MLflow noise."""
    import nbformat
    from nbconvert import HTMLExporter

    (tmp_path / "runs").mkdir()
    nb = execute_headless(
        HEADLESS_CELLS,
        tmp_path,
        {"AIR_MAGIC_RUNS_DIR": str(tmp_path / "runs"), "AIR_MAGIC_DISPLAY": "panel"},
        allow_errors=True,
        unset=("MLFLOW_TRACKING_URI",),  # MLflow's own default: ./mlflow.db beside the notebook
    )
    nbformat.write(nb, tmp_path / "record.ipynb")

    saved = nbformat.read(tmp_path / "record.ipynb", as_version=4)
    outputs = [cell.outputs for cell in saved.cells]
    everything = json.dumps(saved)
    assert "application/vnd.jupyter.widget-view+json" not in everything
    assert "Creating initial MLflow database tables" not in everything and "INFO" not in everything
    assert not (tmp_path / "mlruns").exists(), "MLflow's ./mlruns default is not used"
    assert (tmp_path / "mlflow.db").exists() and (tmp_path / "mlartifacts").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlartifacts", "mlflow.db", "record.ipynb", "runs"]

    (trained,) = [o for o in outputs[1] if o["output_type"] == "display_data"]
    text, page = trained["data"]["text/plain"], trained["data"]["text/html"]
    assert "finished" in text and "MLflow run: " in text and "workflowType=machine_learning" in text
    for rank in (0, 1):
        assert f"[rank {rank}] step 99 on rank {rank}" in text and f"step 99 on rank {rank}" in page
        assert f"step 0 on rank {rank}" not in page, "the record keeps the last lines only"
    assert "60 earlier line(s) not shown; full log: " in page and "rank-0.log" in page
    assert page.count('class="air-magic-chart"') == 3 and "<svg" in page  # loss, acc, lr
    assert "loss" in text and "rank 1: 1.01" in text

    (failed,) = [o for o in outputs[2] if o["output_type"] == "display_data"]
    assert "failed" in failed["data"]["text/plain"] and "rank 1: failed" in failed["data"]["text/html"]
    assert "about to fail on rank 1" in failed["data"]["text/html"]
    assert [o["ename"] for o in outputs[2] if o["output_type"] == "error"] == ["ValueError"]

    (untracked,) = [o for o in outputs[3] if o["output_type"] == "display_data"]
    assert "mlflow imported: False" in untracked["data"]["text/plain"]
    assert "MLflow" not in untracked["data"]["text/plain"] and "air-magic-chart" not in untracked["data"]["text/html"]

    html_page, _ = HTMLExporter().from_notebook_node(saved)
    for rank in (0, 1):
        assert f"step 99 on rank {rank}" in html_page and f"untracked rank {rank}" in html_page
    assert "VBox(" not in html_page and "Error displaying widget" not in html_page


def test_a_script_prints_rank_prefixed_lines_and_the_link_once(tmp_path):
    """Outside Jupyter the call prints plain '[rank N]' lines and the run link exactly once."""
    script = tmp_path / "train.py"
    script.write_text(
        """
import sys
from air_magic import distributed
from air_magic.calls import runner
from air_magic.owner import owner
from air_magic.display import make_display
from air_magic.listeners import Listener

class Link(Listener):
    def on_start(self, ctx):
        ctx.links["mlflow"] = "http://127.0.0.1:5000/#/experiments/0/runs/abc"

@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def hello():
    import os
    print("hello from rank", os.environ["RANK"])
    return 1

spec = hello.settings.spec(hello.func, (), {}, "hello")
display = make_display(spec)
print("display:", type(display).__name__)
print(owner().submit(spec, listeners=[Link(), display]).values)
"""
    )
    env = process_env({"AIR_MAGIC_RUNS_DIR": str(tmp_path / "runs")})
    env.pop("AIR_MAGIC_DISPLAY", None)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, check=False, text=True, env=env, timeout=180
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "display: TextDisplay" in lines
    assert "[rank 0] hello from rank 0" in lines and "[rank 1] hello from rank 1" in lines
    assert sum("MLflow run: http://127.0.0.1:5000/#/experiments/0/runs/abc" in line for line in lines) == 1
    assert lines[-1] == "[1, 1]"


def test_terminal_ipython_gets_the_plain_text_display(tmp_path):
    """A terminal IPython session (no kernel) picks the plain-text display, not the panel."""
    env = process_env()  # this checkout first on the path the installed packages come from
    env.pop("AIR_MAGIC_DISPLAY", None)
    code = (
        "from air_magic.display import make_display; from air_magic.decorator import distributed; "
        "f = distributed(num_accelerators=2, accelerator_type='CPU')(print); "
        "print('display:', type(make_display(f.settings.spec(print, (), {}, 'p'))).__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--HistoryManager.enabled=False", "--colors=nocolor", "-c", code],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "display: TextDisplay" in done.stdout


def test_the_profile_button_profiles_the_running_call_and_shows_its_table(lab_kernel):
    """A Profile click while the call runs profiles 5 steps of every rank and shows the table under the header; the
    ranks go on until Stop."""
    mirror = WidgetMirror()
    seen: dict[str, Any] = {}

    def button(m: WidgetMirror, css: str) -> str:
        return next(cid for cid, s in m.of_model("ButtonModel") if css in s.get("_dom_classes", ()))

    def view(m: WidgetMirror) -> str:
        found = [s["value"] for _, s in m.of_model("HTMLModel") if "air-magic-profile" in s.get("_dom_classes", ())]
        return found[-1] if found else ""

    def drive(m: WidgetMirror) -> None:
        if not m.of_model("TabModel"):
            return
        if "profile" not in seen and all("looping" in log for log in m.panel()["logs"]):
            click(lab_kernel, button(m, "air-magic-profile-button"))
            seen["profile"] = True
        elif "profile" in seen and "stop" not in seen and "collective ms" in view(m):
            seen["table"] = view(m)
            click(lab_kernel, button(m, "air-magic-stop"))
            seen["stop"] = True

    out = run_cell(
        lab_kernel,
        """
@distributed(num_accelerators=2, accelerator_type="CPU", mlflow=False)
def loop():
    import time, torch, torch.distributed as dist, air_magic
    dist.init_process_group("gloo")
    print("looping", flush=True)
    done = 0
    while done < 6000:
        stop = torch.tensor([float(air_magic.should_stop())])
        dist.all_reduce(stop)  # every rank stops at the same step
        if stop.item():
            break
        time.sleep(0.01)
        air_magic.step()
        done += 1
    dist.destroy_process_group()
    return done
loop.distributed()
""",
        mirror,
        timeout=240,
        while_running=drive,
    ).check()
    assert "table" in seen, f"the profile view never showed a table: {view(mirror)!r}"
    assert "profiled 5 step(s)" in seen["table"] and "profile-1.trace.json" in seen["table"]
    done = json.loads(out.result or "[]")
    assert done[0] == done[1] > 7  # both ranks went on after the window, until the Stop
    assert "profiled 5 step(s)" in out.displays[-1]["data"]["text/plain"]  # the record keeps the table
