"""The command line as users try it, a subprocess, with a local MLflow store (sqlite): the link `run --watch` prints
opens the run in a UI that `run --watch` serves while it follows; `cancel --all -y` says what it cancelled; once the
call's owner is gone `get` sends to `air-magic ui ID`, which serves the run on 127.0.0.1 only until Ctrl-C; `get
--watch` of a failed function workload shows the rank's exception and exits 1; an unknown or ambiguous id is one
line and exit code 2."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

FUNCTIONS = """\
import os, pathlib, time

def wait(flag):
    print("waiting on rank", os.environ["RANK"], flush=True)
    while not pathlib.Path(flag).exists():
        time.sleep(0.1)

def boom(x):
    if os.environ["RANK"] == "1":
        raise ValueError(f"bad x {x}")
    return x
"""

JOB = """\
experiment_name: ui-tests
compute: {num_accelerators: 2, accelerator_type: CPU}
function: fns:wait
args: [never]
code_source: {type: snapshot, snapshot: {root_path: code}}
max_retries: 0
"""


#: The files of the directory the fixture `cli` (tests/conftest.py) runs `air-magic` in.
CLI_FILES = {"code/fns.py": FUNCTIONS, "job.yaml": JOB}


def _line_with(proc: subprocess.Popen[str], text: str, seen: list[str]) -> str:
    """The first line of `proc`'s output that holds `text` (the lines before it go into `seen`)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return line
    raise AssertionError(f"no {text!r} in:\n{''.join(seen)}")


@contextlib.contextmanager
def _killed(proc: subprocess.Popen[str]):
    """`proc` is killed when the block ends, however it ends (its end is then waited for by `with proc`)."""
    try:
        yield
    finally:
        proc.kill()


def _run_in_ui(link: str, run_id: str) -> dict:
    """The run as the MLflow UI behind `link` serves it (its REST API, as its page asks it)."""
    base = link.split("#", 1)[0]
    with urllib.request.urlopen(f"{base}api/2.0/mlflow/runs/get?run_id={run_id}", timeout=180) as reply:
        return json.loads(reply.read())["run"]["info"]


def test_the_mlflow_link_of_a_local_store_opens_while_watching_and_later_with_air_magic_ui(cli):
    """While `run --watch` follows, its link opens the run; `cancel --all` names what it cancelled; after the
    owner's end `get` names `air-magic ui ID`, whose UI serves the run on 127.0.0.1 only and ends at Ctrl-C."""
    seen: list[str] = []
    with cli.start("run", "-f", "job.yaml", "--watch") as watch, _killed(watch):
        link = _line_with(watch, "MLflow run: ", seen).split("MLflow run: ", 1)[1].strip()
        assert link.startswith("http://127.0.0.1:")
        call_id = next(line for line in seen if "Run ID: " in line).split("Run ID: ", 1)[1].split()[0]
        run_id = link.split("/runs/", 1)[1].split("?", 1)[0]
        assert _run_in_ui(link, run_id)["status"] == "RUNNING"
        cancelled = cli("cancel", "--all", "-y")
        assert cancelled.returncode == 0, cancelled
        assert f"Successfully requested cancellation for run {call_id}" in cancelled.stdout, cancelled
        assert watch.wait(120) == 1, "".join(seen)
    got = cli("get", call_id)
    assert f"mlflow: {run_id} (open it: air-magic ui {call_id})" in got.stdout, got.stdout
    assert json.loads(cli("get", call_id, "--json").stdout)["data"]["mlflow_url"] is None
    seen = []
    with cli.start("ui", call_id[:24]) as ui, _killed(ui):
        link = _line_with(ui, "MLflow run: ", seen).split("MLflow run: ", 1)[1].strip()
        _line_with(ui, "the MLflow UI is ready", seen)
        assert _run_in_ui(link, run_id)["status"] == "KILLED"
        tree = [psutil.Process(ui.pid), *psutil.Process(ui.pid).children(recursive=True)]
        listening = {c.laddr.ip for p in tree for c in p.net_connections() if c.status == psutil.CONN_LISTEN}
        assert listening == {"127.0.0.1"}, listening
        ui.send_signal(signal.SIGINT)
        assert ui.wait(60) == 0, "".join(seen)
        gone = psutil.wait_procs(tree[1:], timeout=60)[1]
        assert not gone, gone


def test_get_of_a_failed_function_shows_the_ranks_exception_and_bad_ids_are_one_line(cli):
    """`get --watch` waits for the end, shows rank 1's exception with its traceback, and exits 1; an unknown id and
    an ambiguous prefix are one line each with exit code 2; `cancel --all` with nothing running says so."""
    started = cli("run", "-f", "job.yaml", "--override", "function=fns:boom", "--override", "args=[3]")
    call_id = started.stdout.split("Run ID: ", 1)[1].split()[0]
    got = cli("get", call_id, "--watch")
    assert got.returncode == 1, got.stdout + got.stderr
    assert "rank 1: failed ValueError: bad x 3" in got.stdout
    assert "rank 1 raised ValueError: bad x 3" in got.stdout and "in boom" in got.stdout, got.stdout
    unknown = cli("get", "nothing-like-this")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
    assert "no call 'nothing-like-this'" in unknown.stderr and "Traceback" not in unknown.stderr
    if (
        len(json.loads(cli("list", "--all-status", "--json").stdout)["data"]["runs"]) < 2
    ):  # a prefix of two calls' ids is needed
        second = cli("run", "-f", "job.yaml", "--override", "function=fns:boom", "--override", "args=[4]")
        assert second.returncode == 0, second.stderr
        assert (
            cli("get", second.stdout.split("Run ID: ", 1)[1].split()[0], "--watch").returncode == 1
        )  # over before `cancel --all` below
    ambiguous = cli("logs", call_id[:2])  # every call of this module starts with the same year
    assert ambiguous.returncode == 2 and len(ambiguous.stderr.strip().splitlines()) == 1, ambiguous.stderr
    assert "names 2 calls" in ambiguous.stderr
    nothing = cli("cancel", "--all")
    assert nothing.stdout.strip() == "air-magic: no run is waiting or running; nothing to cancel"
    assert Path(json.loads(cli("get", call_id, "--json").stdout)["data"]["run_dir"]).name == call_id
