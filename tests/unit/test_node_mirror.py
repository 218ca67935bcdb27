"""What a command run's node on another machine sends back (launch/files/node_mirror.py): files that grow travel as
what was appended, files replaced whole travel whole, two nodes' alerts end in one file of whole lines, and a FIFO,
a half-written replacement and a name outside the run directory never travel."""

from __future__ import annotations

import json
import os

from air_magic.launch.files import node_mirror
from air_magic.launch.files.node_mirror import Change, Mirror


def _node(root, node: int):
    directory = root / "attempts" / "attempt_0" / f"node_{node}"
    directory.mkdir(parents=True)
    return directory


def test_a_node_s_files_arrive_here_as_they_grow_and_change(tmp_path):
    there, here = tmp_path / "node", tmp_path / "call"
    here.mkdir()
    ranks = _node(there, 0)
    log = ranks / "rank_0.log"
    log.write_bytes(b"step 1\n")
    (ranks / "rank_0.json").write_text(json.dumps({"pid": 1}))
    os.mkfifo(ranks / "rank_0.debug.in")  # a debugger's FIFO: reading it would block the poll
    (ranks / "rank_0.usage.json.tmp").write_text("{")  # a replacement half written
    mirror = Mirror(there)

    first = mirror.changes()
    assert sorted(c.name for c in first) == [
        "attempts/attempt_0/node_0/rank_0.json",
        "attempts/attempt_0/node_0/rank_0.log",
    ]
    node_mirror.apply(here, first)
    assert mirror.changes() == []  # nothing changed: nothing sent

    with open(log, "ab") as f:
        f.write(b"step 2\n")
    tmp = ranks / "rank_0.json.tmp"
    tmp.write_text(json.dumps({"pid": 2}))
    os.replace(tmp, ranks / "rank_0.json")
    second = mirror.changes()
    by_name = {c.name.rsplit("/", 1)[1]: c for c in second}
    assert by_name["rank_0.log"] == Change("attempts/attempt_0/node_0/rank_0.log", b"step 2\n", appended=True)
    assert not by_name["rank_0.json"].appended
    node_mirror.apply(here, second)
    copied = here / "attempts" / "attempt_0" / "node_0"
    assert (copied / "rank_0.log").read_bytes() == b"step 1\nstep 2\n"
    assert json.loads((copied / "rank_0.json").read_text()) == {"pid": 2}
    assert sorted(p.name for p in copied.iterdir()) == ["rank_0.json", "rank_0.log"]


def test_a_big_log_comes_in_chunks_and_says_more_is_left(tmp_path):
    there, here = tmp_path / "node", tmp_path / "call"
    here.mkdir()
    data = os.urandom(node_mirror.CHUNK + 1000)
    (_node(there, 0) / "rank_0.log").write_bytes(data)
    mirror = Mirror(there)
    node_mirror.apply(here, mirror.changes())
    assert mirror.more
    node_mirror.apply(here, mirror.changes())
    assert not mirror.more
    assert (here / "attempts" / "attempt_0" / "node_0" / "rank_0.log").read_bytes() == data


def test_two_nodes_alerts_end_in_one_file_of_whole_lines(tmp_path):
    here = tmp_path / "call"
    here.mkdir()
    mirrors = []
    for node in (0, 1):
        there = tmp_path / f"node{node}"
        there.mkdir()
        (there / "alerts.jsonl").write_bytes(json.dumps({"node": node, "kind": "oom"}).encode() + b'\n{"node"')
        mirrors.append(Mirror(there))
    for mirror in mirrors:
        node_mirror.apply(here, mirror.changes())
    lines = (here / "alerts.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["node"] for line in lines) == [0, 1]  # the half-written lines wait
    with open(tmp_path / "node1" / "alerts.jsonl", "ab") as f:
        f.write(b': 1, "kind": "nccl"}\n')
    node_mirror.apply(here, mirrors[1].changes())
    kinds = [json.loads(line)["kind"] for line in (here / "alerts.jsonl").read_text().splitlines()]
    assert sorted(kinds) == ["nccl", "oom", "oom"]


def test_a_name_outside_the_run_directory_is_not_written(tmp_path):
    here = tmp_path / "call"
    here.mkdir()
    node_mirror.apply(here, [Change("../escaped.json", b"{}", appended=False)])
    assert not (tmp_path / "escaped.json").exists()


def test_a_reader_that_holds_a_growing_file_open_sees_what_arrives(tmp_path):
    """`air-magic stacks` opens a rank's stacks file before it asks, and reads what is added to that file."""
    there, here = tmp_path / "node", tmp_path / "call"
    stacks = _node(there, 1) / "rank_1.stacks"
    local = here / "attempts" / "attempt_0" / "node_1" / "rank_1.stacks"
    local.parent.mkdir(parents=True)
    fd = os.open(local, os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        stacks.write_bytes(b"Thread 0x1 (most recent call first):\n")
        node_mirror.apply(here, Mirror(there).changes())
        assert os.pread(fd, 100, 0) == b"Thread 0x1 (most recent call first):\n"
    finally:
        os.close(fd)
