"""Reading every rank's log again from its first byte (a panel drawn again, the record of an ended call): the same
LogTail the launchers use, from the start."""

from __future__ import annotations

import json
from types import SimpleNamespace

from air_magic.display.follow import LogReader, record_of
from air_magic.job import JobResult, JobSpec, JobStatus, RankResult
from air_magic.launch.files import command_logs
from air_magic.launch.files.rank_files import LogTail
from air_magic.launch.files.rundir import RunDir


def test_a_reader_made_late_gets_every_byte_then_only_what_is_new(tmp_path):
    """Lines written before the reader was made come first; a later read gives only the new text, per rank."""
    logs = RunDir(tmp_path).logs(2)
    logs[0].write_text("before 0\n")
    logs[1].write_text("")
    reader = LogReader(tmp_path, 2)
    assert reader.read() == {0: "before 0\n"}
    with open(logs[1], "a") as f:
        f.write("after 1\n")
    assert reader.read() == {1: "after 1\n"}
    assert reader.read() == {}


def test_a_log_over_one_read_chunk_comes_in_chunks_and_an_ended_calls_record_shows_its_last_lines(tmp_path):
    """Each read gives at most a chunk a rank, the next one the rest; the record of an ended call reads to the end."""
    logs = RunDir(tmp_path).logs(2)
    logs[0].write_text("x" * 3_000_000 + "\nlast line of rank 0\n")
    logs[1].write_text("rank 1 said little\n")
    reader, read = LogReader(tmp_path, 2), ""
    first = reader.read()
    assert len(first[0]) < 3_000_000 and first[1] == "rank 1 said little\n"
    read = first[0]
    while chunk := reader.read():
        read += chunk[0]
    assert len(read) == 3_000_021 and read.endswith("last line of rank 0\n")
    spec = JobSpec(target=print, args=(), kwargs={}, name="f", world_size=2, accelerator_type="CPU", timeout=None)
    result = JobResult(spec, tmp_path, [RankResult(0), RankResult(1)], status=JobStatus.FINISHED)
    call = SimpleNamespace(job=lambda: result, link=None, listeners=[])
    html = record_of(call)["text/html"]
    assert "last line of rank 0" in html and "rank 1 said little" in html


def test_a_character_cut_between_reads_is_whole_and_a_final_read_ends_an_unfinished_one(tmp_path):
    """UTF-8 split across writes decodes once complete; `final` turns a dangling byte into a replacement."""
    log = RunDir(tmp_path).logs(1)[0]
    snowman = "☃".encode()
    log.write_bytes(b"a" + snowman[:1])
    reader = LogReader(tmp_path, 1)
    assert reader.read() == {0: "a"}
    with open(log, "ab") as f:
        f.write(snowman[1:] + b"\n" + snowman[:1])
    assert reader.read() == {0: "☃\n"}
    assert reader.read(final=True) == {0: "\ufffd"}


def test_a_launchers_tail_still_starts_at_the_end(tmp_path):
    """LogTail made without from_start skips what an earlier attempt wrote."""
    log = tmp_path / "rank-0.log"
    log.write_text("attempt 1\n")
    tail = LogTail(log)
    with open(log, "a") as f:
        f.write("attempt 2\n")
    assert tail.read_all() == ["attempt 2\n"]


def test_a_command_runs_tabs_follow_each_rank_of_the_newest_attempt_after_the_nodes_output(tmp_path):
    """In a command run's directory, tab R shows its unit's log (the node's output) until the command's rank R has a
    log, then that rank's own log; a retry's rank R follows with a line naming the attempt; the record shows each
    rank's own lines and links its log."""
    logs = RunDir(tmp_path).logs(2)
    logs[0].write_text("torchrun starts 2 ranks\n")
    logs[1].write_text("")
    (tmp_path / command_logs.INFO).write_text(json.dumps({"kind": "command", "per_node": 2}))
    reader = LogReader(tmp_path, 2, command_ranks=True)
    assert reader.read() == {0: "torchrun starts 2 ranks\n"}
    node = command_logs.node_dir(tmp_path, 0, 0)
    node.mkdir(parents=True)
    (node / "rank_0.log").write_text("rank 0 alone\n")
    (node / "rank_1.log").write_text("rank 1 alone\n")
    with open(logs[0], "a") as f:
        f.write("[rank0]: rank 0 alone\n[rank1]: rank 1 alone\n")  # the node's log has both: not shown again
    assert reader.read() == {0: "rank 0 alone\n", 1: "rank 1 alone\n"}
    with open(node / "rank_1.log", "a") as f:
        f.write("rank 1 fails\n")
    again = command_logs.node_dir(tmp_path, 1, 0)
    again.mkdir(parents=True)
    (again / "rank_1.log").write_text("rank 1 once more\n")
    assert reader.read() == {
        1: "rank 1 fails\nair_magic: attempt 1 of the run: rank 1 starts again\nrank 1 once more\n"
    }
    assert reader.paths == [node / "rank_0.log", again / "rank_1.log"]  # rank 0 of attempt 1 has not started yet
    assert LogReader(tmp_path, 2).read() == {0: logs[0].read_text()}  # the command line's reader: the node's output
    spec = JobSpec(target=print, args=(), kwargs={}, name="run", world_size=2, accelerator_type="CPU", timeout=None)
    result = JobResult(spec, tmp_path, [RankResult(0), RankResult(1)], status=JobStatus.FINISHED)
    record = record_of(SimpleNamespace(job=lambda: result, link=None, listeners=[]))["text/html"]
    assert "rank 1 once more" in record and "rank 0 alone" in record and "torchrun starts" not in record
    assert str(again / "rank_1.log") in record and str(node / "rank_0.log") in record
