"""The ranks a command run's own torchrun starts are ranks of the run (the rank hook, cli/command_rank.py): each
keeps its log (`logs --rank R`, C-level output too, `--minutes`), answers `air-magic stacks` with the stack of
where it waits, ends its `should_stop()` loop on `air-magic stop`, and stops at `breakpoint()` for `air-magic
attach` to answer; the user's own sitecustomize still runs; the
node's watch names a straggling and a hung rank (cli/command_watch.py). A torchrun run of 2 CPU ranks (gloo) serves
the first checks, another the watch's; the hook's chaining is also checked in a bare process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import in_order, mlflow_run, wait_until

from air_magic import envvars
from air_magic.cli.node import RANK_HOOK_DIR

pytestmark = pytest.mark.slow

TRAIN = """\
import os, sys, time
import torch.distributed as dist
import air_magic
import sitecustomize

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"only-rank-{rank}-says-this", flush=True)
os.write(2, f"c-level-write-of-rank-{rank}\\n".encode())
print(f"user-site-{rank}-{getattr(sitecustomize, 'USER_SITE', 'missing')}", flush=True)


def waiting_in_the_loop():
    while not air_magic.should_stop():
        time.sleep(0.05)


waiting_in_the_loop()
print(f"rank {rank} stopped", flush=True)
dist.destroy_process_group()
if rank == 1:
    x = 41
    breakpoint()
    print(f"after the breakpoint {x + 1}", flush=True)
"""

USER_SITE = "USER_SITE = 'ran'\n"

JOB = """\
experiment_name: cli-ranks
compute: {num_accelerators: 2, accelerator_type: CPU}
code_source: {type: snapshot, snapshot: {root_path: code}}
env_variables: {PYTHONPATH: USERSITE}
max_retries: 0
timeout_minutes: 5
command: torchrun --nproc_per_node=2 $CODE_SOURCE_PATH/train.py
"""

#: Rank 1 computes 0.15 s longer than rank 0 in each of 40 steps, then stays away from the next all-reduce for 12 s.
WATCHED = """\
import time
import torch
import torch.distributed as dist
import air_magic

dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(40):
    if rank == 1:
        time.sleep(0.15)
    dist.all_reduce(torch.ones(1))
    air_magic.step()


def away_from_the_all_reduce():
    time.sleep(12)


if rank == 1:
    away_from_the_all_reduce()
dist.all_reduce(torch.ones(1))
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""

WATCH_JOB = """\
experiment_name: cli-watch
compute: {num_accelerators: 2, accelerator_type: CPU}
code_source: {type: snapshot, snapshot: {root_path: code}}
env_variables: {AIR_MAGIC_HANG_AFTER: "3"}
max_retries: 0
timeout_minutes: 5
command: torchrun --nproc_per_node=2 $CODE_SOURCE_PATH/watched.py
"""

CLI_FILES = {"code/train.py": TRAIN, "code/watched.py": WATCHED, "usersite/sitecustomize.py": USER_SITE}


def _data_of(done) -> dict:
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)["data"]


def _rank_log(cli, run_id: str, rank: int) -> Path:
    return cli.root / "runs" / run_id / "attempts" / "attempt_0" / "node_0" / f"rank_{rank}.log"


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_torchrun_commands_ranks_have_their_logs_stacks_stop_and_breakpoint(cli):
    (cli.root / "ranks.yaml").write_text(JOB.replace("USERSITE", str(cli.root / "usersite")))
    done = cli("run", "-f", "ranks.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = done.stdout.split("Submitted workload with Run ID: ", 1)[1].split()[0]
    try:
        for rank in (0, 1):
            wait_until(
                lambda rank=rank: f"user-site-{rank}-" in _text(_rank_log(cli, run_id, rank)),
                120,
                f"rank {rank}'s log",
            )

        one = cli("logs", run_id, "--rank", "1")
        assert one.returncode == 0, one.stdout + one.stderr
        assert "only-rank-1-says-this" in one.stdout and "c-level-write-of-rank-1" in one.stdout
        assert "user-site-1-ran" in one.stdout  # the user's sitecustomize ran after the hook's
        assert "only-rank-0" not in one.stdout
        zero = cli("logs", run_id, "--rank", "0", "--node", "0", "--minutes", "10")
        assert "only-rank-0-says-this" in zero.stdout and "rank-1" not in zero.stdout, zero.stdout + zero.stderr
        node = cli("logs", run_id, "--minutes", "10")  # the node's log still has every rank's output
        assert "only-rank-0-says-this" in node.stdout and "only-rank-1-says-this" in node.stdout
        missing = cli("logs", run_id, "--rank", "7")
        assert missing.returncode == 2 and "has ranks [0, 1]" in missing.stderr

        stacks = cli("stacks", run_id)
        assert stacks.returncode == 0, stacks.stdout + stacks.stderr
        dumps = stacks.stdout.split("== rank ")[1:]
        assert [d.split()[0] for d in dumps] == ["0", "1"], stacks.stdout
        assert all("waiting_in_the_loop" in d for d in dumps), stacks.stdout
        as_json = json.loads(cli("stacks", run_id, "--rank", "1", "-o", "json").stdout)["data"]
        assert [(r["rank"], r["state"]) for r in as_json["ranks"]] == [(1, "answered")]
        assert "waiting_in_the_loop" in as_json["ranks"][0]["stacks"]
        assert "waiting_in_the_loop" not in _text(_rank_log(cli, run_id, 1))  # the dumps stay out of the log

        assert cli("stop", run_id).returncode == 0
        # rank 1 then stops at breakpoint(): `attach` answers its prompt from standard input
        attached = cli("attach", run_id, input="p x\nc\n", timeout=180)
        assert attached.returncode == 0, attached.stdout + attached.stderr
        assert in_order(attached.stdout, "(Pdb rank 1) p x\n", "41\n", "(Pdb rank 1) c\n"), attached.stdout
        assert "after the breakpoint 42" in attached.stdout, attached.stdout.replace("\n", " | ")
        assert not list(_rank_log(cli, run_id, 1).parent.glob("debug-*"))  # the node removed the prompt's files
        assert _data_of(cli("get", run_id, "-o", "json"))["status"] == "SUCCESS"
        assert "rank 1 stopped" in cli("logs", run_id, "--rank", "1").stdout
    finally:
        cli("cancel", run_id)
    # the panel of the run attached from Python: a section per torchrun rank, each with that rank's own lines
    record = _attached(cli, ATTACHED, run_id)
    assert record.returncode == 0, record.stdout + record.stderr
    sections = dict(json.loads(record.stdout))
    assert sorted(sections) == ["0", "1"], record.stdout
    assert "only-rank-0-says-this" in sections["0"] and "only-rank-1" not in sections["0"], sections
    assert "only-rank-1-says-this" in sections["1"] and "after the breakpoint 42" in sections["1"], sections
    assert "only-rank-0" not in sections["1"], sections


def _attached(cli, script: str, run_id: str) -> subprocess.CompletedProcess[str]:
    """`script` run by Python in the CLI's environment, with the run's id as its argument (it attaches to the run)."""
    return subprocess.run(
        [sys.executable, "-c", script, run_id],
        check=False,
        env=cli.env,
        cwd=cli.root,
        capture_output=True,
        text=True,
        timeout=120,
    )


#: Attach to the run given, wait for its end, print each rank's part of its record: [[rank, html], ...].
ATTACHED = """
import json, re, sys
import air_magic
from air_magic.display.follow import record_of
call = air_magic.attach(sys.argv[1], show=False)
call.job(timeout=60)
parts = re.split(r'<details class="air-magic-record-rank"', record_of(call)["text/html"])[1:]
print(json.dumps([[re.search(r"rank (\\d+)", p).group(1), p] for p in parts]))
"""


def test_the_watch_names_a_torchrun_rank_that_straggles_then_hangs_live_in_the_record_and_in_mlflow(cli):
    """Rank 1 is named a straggler by its compute, then hung (AIR_MAGIC_HANG_AFTER=3 from env_variables) while rank 0
    waits in the all-reduce it has not reached: both while the run goes on, in `get`'s alerts, as ALERT lines of the
    node's log in `logs -o json`, and as tags of the attempt's MLflow run; the hung rank's stacks show where it is;
    `get` has each rank's node, pid and peak memory; the run's metrics have each rank's step times (rank 1's compute
    the longer) and memory, named as a function run's."""
    (cli.root / "watch.yaml").write_text(WATCH_JOB)
    done = cli("run", "-f", "watch.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = done.stdout.split("Submitted workload with Run ID: ", 1)[1].split()[0]
    try:

        def alerts() -> list[dict]:
            return json.loads(cli("get", run_id, "--json").stdout)["data"]["alerts"]

        wait_until(lambda: any(a["kind"] == "hang" for a in alerts()), 180, "a hang alert while the run goes on")
        assert json.loads(cli("get", run_id, "--json").stdout)["data"]["status"] == "RUNNING"  # named live
        ended = cli("get", run_id, "--watch", "-o", "json")
        assert json.loads(ended.stdout.splitlines()[-1])["data"]["status"] == "SUCCESS", ended.stdout
    finally:
        cli("cancel", run_id)
    got = json.loads(cli("get", run_id, "--json").stdout)["data"]
    kinds = {(a["kind"], a["rank"]): a["line"] for a in got["alerts"]}
    assert set(kinds) == {("straggler", 1), ("hang", 1)}, got["alerts"]
    assert "rank 1 is a straggler" in kinds["straggler", 1] and "its compute" in kinds["straggler", 1]
    assert "rank 1 hangs" in kinds["hang", 1] and "rank 0 waits in all_reduce" in kinds["hang", 1]
    stacks = cli.root / "runs" / run_id / "attempts" / "attempt_0" / "node_0" / "rank_1.stacks"
    assert str(stacks) in kinds["hang", 1] and "away_from_the_all_reduce" in _text(stacks)
    events = [json.loads(line) for line in cli("logs", run_id, "-o", "json").stdout.splitlines()]
    alerted = [(e["kind"], e["line"]) for e in events if e.get("type") == "ALERT"]
    assert alerted == [("straggler", kinds["straggler", 1]), ("hang", kinds["hang", 1])], alerted
    used = {r["rank"]: r for r in got["command_ranks"]}
    assert sorted(used) == [0, 1] and not any(r["running"] for r in used.values()), got["command_ranks"]
    assert all(r["node"] == 0 and r["peak_memory"] > 50 * 2**20 for r in used.values()), got["command_ranks"]  # torch
    assert "rank 1 (node 0, pid" in cli("get", run_id).stdout
    run = mlflow_run(cli, got["mlflow_run_id"])
    tags, metrics, highest = run["tags"], run["metrics"], run["highest"]
    assert sorted(v.split(":")[0] for k, v in tags.items() if k.startswith("air_magic.alert_")) == [
        "hang on node 0",
        "straggler on node 0",
    ], tags
    assert metrics["watch/rank_1/compute"] > metrics["watch/rank_0/compute"] + 0.1, metrics  # it slept 0.15 s a step
    assert metrics["watch/rank_0/collective_wait"] > 0.1 and "watch/rank_1/straggler_lag" in metrics, metrics
    # what each rank held while it ran (the last sample can be of a rank freeing its memory as it exits)
    assert all(highest[f"system/command_rank_{r}/memory_mib"] > 50 for r in (0, 1)), highest
    # the run attached from Python: its handle's alerts, each under the rank named, and its record shows them
    attached = _attached(cli, ATTACHED_ALERTS, run_id)
    assert attached.returncode == 0, attached.stdout + attached.stderr
    alerts, shown = json.loads(attached.stdout)
    assert alerts == [["straggler", 1, "compute"], ["hang", 1, "no progress"]], attached.stdout
    assert shown, attached.stdout


#: Attach to the ended run given: its handle's alerts [[kind, rank, cause], ...], and whether its record shows them.
ATTACHED_ALERTS = """
import json, sys
import air_magic
from air_magic.display.follow import record_of
call = air_magic.attach(sys.argv[1], show=False)
call.job(timeout=60)
html = record_of(call)["text/html"]
shown = all(a.message.split(":")[0] in html for a in call.alerts)
print(json.dumps([[[a.kind, a.rank, a.cause] for a in call.alerts], shown]))
"""


def _python(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)


def test_the_hook_chains_to_the_next_sitecustomize_and_imports_nothing_heavy(tmp_path):
    """In a rank (RANK and LOCAL_RANK set) and outside one, the next sitecustomize on sys.path runs as
    `sitecustomize`; the rank imports neither the air_magic package nor torch, IPython or MLflow, and its
    children are not ranks of their own; a failing user sitecustomize is said as Python says it."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("CHAINED = True\n")
    base = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", envvars.RANK_DIR, envvars.RANK_HOOKED)
    }
    base["PYTHONPATH"] = os.pathsep.join([str(RANK_HOOK_DIR), str(user)])
    probe = (
        "import json, subprocess, sys, sitecustomize; "
        "print(json.dumps([getattr(sitecustomize, 'CHAINED', False), "
        "[m for m in ('air_magic', 'torch', 'IPython', 'mlflow') if m in sys.modules]])); "
        "subprocess.run([sys.executable, '-c', 'print(1)'], check=True)"
    )
    plain = _python(base, probe)
    assert json.loads(plain.stdout.splitlines()[0]) == [True, []], plain.stderr
    assert not (tmp_path / "node_0").exists()

    rank_env = {**base, "RANK": "3", "LOCAL_RANK": "1", envvars.RANK_DIR: str(tmp_path / "node_0")}
    rank = _python(rank_env, probe)
    assert json.loads(rank.stdout.splitlines()[0]) == [True, []], rank.stderr
    assert sorted(p.name for p in (tmp_path / "node_0").iterdir()) == [
        "rank_3.json",
        "rank_3.log",
        "rank_3.log.times",
        "rank_3.stacks",
    ]
    info = json.loads((tmp_path / "node_0" / "rank_3.json").read_text())
    assert (info["rank"], info["local_rank"]) == (3, 1)
    assert (tmp_path / "node_0" / "rank_3.log").read_text().endswith("[true, []]\n1\n")  # its child's line too

    (user / "sitecustomize.py").write_text("raise ValueError('broken on purpose')\n")
    broken = _python(rank_env, "print('runs on')")
    assert broken.stdout == "runs on\n" and "ValueError: broken on purpose" in broken.stderr


def test_a_rank_records_its_steps_only_once_its_code_has_imported_torch(tmp_path):
    """The hook starts the step recorder when the rank's code imports torch, not sooner: a thread count the code sets
    before that import still holds, and the steps file is there after it."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", envvars.RANK_HOOKED)}
    env = {**base, "PYTHONPATH": str(RANK_HOOK_DIR), "RANK": "0", "LOCAL_RANK": "0", envvars.RANK_DIR: str(tmp_path)}
    probe = (
        "import json, os, sys; before = [m for m in ('air_magic', 'torch') if m in sys.modules]; "
        "os.environ['OMP_NUM_THREADS'] = '1'; import torch; "
        "print(json.dumps([before, torch.get_num_threads(), 'air_magic.launch.rank.steps' in sys.modules]))"
    )
    done = _python(env, probe)
    assert json.loads(done.stdout.splitlines()[0]) == [[], 1, True], done.stdout + done.stderr
    assert (tmp_path / "rank_0.steps.json").exists()
    off = _python({**env, envvars.RANK_HOOK: "no-watch", envvars.RANK_DIR: str(tmp_path / "off")}, probe)
    assert json.loads(off.stdout.splitlines()[0]) == [[], 1, False], off.stdout + off.stderr
