"""The typed records of the process boundary survive their encodings: every message, the job file, the hot call."""

from __future__ import annotations

import json

import pytest

from air_magic.launch import protocol as p

#: One instance of every message the wire carries; a new message type without one here fails the coverage test.
SAMPLES: list[p.Message] = [
    p.LaunchJob(
        job="j1",
        world_size=2,
        fork=True,
        executable="/usr/bin/python3",
        sys_path=["/a", "/b"],
        run_dir="/runs/x",
        env={"A": "1"},
        package_parent="/src",
        keep_alive=60.0,
        world_key="k",
        hooks=["air_magic.tracking.hook"],
        restart_count=1,
        max_restarts=2,
        session="s",
        pool="p1",
    ),
    p.StopJob(job="j1", reason="cancelled", grace=3.0),
    p.StopJob(job="j1", reason="a rank failed", grace=3.0, interrupt_after=3.0),
    p.EndPool(pool="p1", why="%distributed_session --end ended it"),
    p.DumpStacks(job="j1"),
    p.Retire(),
    p.PoolEnded(pool="p1", why="rank 1 (pid 12) was killed by SIGKILL"),
    p.PrepareHooks(hooks=["air_magic.tracking.hook"], env={"MLFLOW_TRACKING_URI": "sqlite:////tmp/ü/mlflow.db"}),
    p.HotCall(run_dir="/runs/y", env={"RANK": "0", "ü": "ß"}),
    p.Event(),
    p.RankStarted(job="j1", rank=1, pid=43),
    p.RankOutput(job="j1", rank=0, text="line\n\u2603"),
    p.RankExited(job="j1", rank=1, returncode=-9, at=1.5),
    p.RankExited(job="j1", rank=0, returncode=1, at=1.5, usable=True),
    p.LaunchFailed(job="j1", message="no store"),
    p.Stale(job="j1", reason="torch changed on disk"),
    p.SessionEnded(job="", session="default", reason="idle for 3600 s (its keep-alive)"),
    p.JobGone(job="j1"),
    p.LauncherDied(job="j1", message="gone"),
]


def test_every_message_type_has_a_sample():
    """Each registered message type is exercised by the round-trip test below."""
    assert {type(m).__name__ for m in SAMPLES} == set(p.Message.registry)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_a_message_decodes_to_what_was_encoded(message):
    """encode then decode gives an equal message of the same type, as one JSON line."""
    line = p.encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert p.decode(line) == message


def test_a_rank_outcome_stays_on_the_notebooks_side():
    """RankExited's outcome (pickled results, exceptions) is not sent over the pipe; it decodes to an empty one."""
    event = p.RankExited("j", 0, 0, 1.0, p.RankOutcome(value=b"result"))
    assert "outcome" not in json.loads(p.encode(event))
    assert p.decode(p.encode(event)).outcome == p.RankOutcome()


def test_a_line_that_is_no_message_is_refused():
    """An unknown type is a ValueError, not a silently wrong message."""
    with pytest.raises(ValueError):
        p.decode(b'{"type": "Nope"}')


def test_launch_job_defaults_keep_old_lines_readable():
    """A LaunchJob line without the optional fields decodes with their defaults."""
    line = json.dumps(
        {
            "type": "LaunchJob",
            "job": "j",
            "world_size": 1,
            "fork": False,
            "executable": "py",
            "sys_path": [],
            "run_dir": "/r",
            "env": {},
            "package_parent": "/s",
        }
    )
    msg = p.decode(line)
    assert isinstance(msg, p.LaunchJob) and msg.hooks == [] and msg.keep_alive is None and msg.pool is None


def test_a_rank_exit_says_whether_the_rank_stays_usable():
    """RankExited carries `usable` over the wire (the caller's keeper decides from it); old lines read as usable."""
    line = p.encode(p.RankExited("j", 0, 1, 1.0, usable=False))
    event = p.decode(line)
    assert isinstance(event, p.RankExited) and event.usable is False
    old = json.dumps({"type": "RankExited", "job": "j", "rank": 0, "returncode": 0, "at": 1.0})
    assert p.decode(old) == p.RankExited("j", 0, 0, 1.0)


def _request(**kw) -> p.JobRequest:
    base = {
        "job_id": "id",
        "name": "train",
        "world_size": 2,
        "payload": b"x",
        "env": {},
        "sys_path": ["/a"],
        "cwd": "/w",
        "hooks": ("air_magic.tracking.hook",),
    }
    return p.JobRequest(**{**base, **kw})


def test_the_job_file_round_trips():
    """job.json carries the name, sys.path, working directory and hooks of the request, and reads back equal."""
    job = p.JobFile.of(_request())
    back = p.JobFile.from_bytes(job.to_bytes())
    assert back == job
    assert back == p.JobFile(name="train", sys_path=["/a"], cwd="/w", hooks=["air_magic.tracking.hook"])


def test_the_job_file_reader_ignores_fields_it_does_not_know():
    """A job file from a newer writer with an extra field still reads."""
    data = json.dumps({"name": "n", "sys_path": [], "cwd": "/", "hooks": [], "extra": 1})
    assert p.JobFile.from_bytes(data) == p.JobFile(name="n", sys_path=[], cwd="/", hooks=[])
