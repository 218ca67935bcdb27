"""Reading every rank's log again from its first byte (a panel drawn again, the record of an ended call): the same
LogTail the launchers use, from the start."""

from __future__ import annotations

from types import SimpleNamespace

from air_magic.display.follow import LogReader, record_of
from air_magic.job import JobResult, JobSpec, JobStatus, RankResult
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
