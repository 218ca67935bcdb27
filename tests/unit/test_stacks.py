"""Stack dumps (air_magic/launch/stacks.py, stack_dumps.py): asking a process for one, and reading them back."""

from __future__ import annotations

import faulthandler
import fcntl
import os
import threading
import time
from pathlib import Path

from air_magic.launch import stacks
from air_magic.launch.files import stack_dumps
from air_magic.launch.files.stack_dumps import StackScanner, parse, where_ranks_were
from air_magic.launch.stacks import STOPPING

ROOT = Path(__file__).resolve().parents[2]
SITE = "/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py"
WORKER = str(ROOT / "air_magic" / "launch" / "worker.py")

#: A dump as faulthandler writes it (most recent call first), with the header and trailer a request adds.
DUMP = f"""
air_magic: stacks of pid 4242 (the rank), before stopping it at 12:00:01, most recent call first:
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/home/me/proj/prefetch.py", line 9 in fill
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "{SITE}", line 4000 in barrier
  File "/tmp/ipykernel_1/123.py", line 7 in waiting_for_the_slow_rank
  File "/tmp/ipykernel_1/123.py", line 12 in train
  File "{WORKER}", line 95 in run
  File "<string>", line 1 in <module>
air_magic: end of the stacks of pid 4242
"""


def test_a_dump_reads_innermost_frame_last_with_the_thread_running_the_call_first():
    """The thread that runs the call comes first, its frames outermost first, and its innermost user frame is named."""
    [dump] = parse("before\n" + DUMP + "after\n")
    assert (dump.pid, dump.of_rank, dump.why, dump.clock) == (4242, True, STOPPING, "12:00:01")
    call, other = dump.threads
    assert call.current and call.runs_the_call
    assert [f.function for f in call.frames] == ["<module>", "run", "train", "waiting_for_the_slow_rank", "barrier"]
    frame = dump.user_frame()
    assert frame is not None and (frame.function, frame.line) == ("waiting_for_the_slow_rank", 7)
    assert other.user_frame().function == "fill"
    text = dump.text().split("\n", 1)[1]  # under the summary line
    assert text.index("in train") < text.index("in waiting_for_the_slow_rank") < text.index("in barrier")
    assert "waiting_for_the_slow_rank   <- innermost user frame" in text


def test_the_thread_that_asked_for_the_dump_is_left_out():
    """A rank that asks itself (a Ray rank) does not show its own asking thread."""
    asking = f"""
Thread 0x00007f0000000003 (most recent call first):
  File "{ROOT / "air_magic" / "launch" / "stacks.py"}", line 199 in _dump_round
  File "{ROOT / "air_magic" / "launch" / "stacks.py"}", line 180 in request
  File "/home/me/proj/actor.py", line 3 in dump_stacks
"""
    [dump] = parse(DUMP.replace("\nThread 0x00007f0000000001", asking + "\nThread 0x00007f0000000001"))
    assert [t.ident for t in dump.threads] == ["0x00007f0000000002", "0x00007f0000000001"]


def test_the_scanner_finds_the_same_dump_however_the_output_is_cut_and_passes_the_rest_through():
    """Fed one character at a time, the scanner returns the text around the dump, a line in its place, and the dump
    once."""
    scanner = StackScanner()
    out, dumps = "", []
    for ch in "step 1\n" + DUMP + "step 2\npartial":
        text, found = scanner.feed(ch)
        out += text
        dumps += found
    assert [d.pid for d in dumps] == [4242]
    assert out.startswith(
        "step 1\n\n[pid 4242 (the rank), before stopping it at 12:00:01: in waiting_for_the_slow_rank"
    )
    assert out.endswith("every thread in the log]\nstep 2\npartial")
    assert "File" not in out and "most recent call first" not in out


def test_output_without_dumps_passes_through_whole_and_a_header_cut_anywhere_is_still_found():
    """Plain output comes back unchanged; a header split over two chunks at any point still starts a dump."""
    plain = "x" * 10_000 + "\nloss 0.1\n\rprogress 50%"
    assert StackScanner().feed(plain) == (plain, [])
    for cut in range(1, 40):
        scanner = StackScanner()
        first, _ = scanner.feed("step\n" + DUMP[:cut])
        rest, dumps = scanner.feed(DUMP[cut:] + "after\n")
        assert len(dumps) == 1 and "File" not in first + rest and (first + rest).endswith("after\n"), cut


def test_output_between_a_dump_and_its_trailer_ends_the_dump_and_is_kept():
    """A line the rank prints right after its dump, before the trailer, is shown, and the trailer is not."""
    text = DUMP.replace("air_magic: end of", "started\nair_magic: end of")
    out, dumps = StackScanner().feed(text, final=True)
    assert len(dumps) == 1 and "started\n" in out and "end of the stacks" not in out


def test_a_real_faulthandler_dump_of_this_process_parses():
    """What faulthandler writes here, for every thread, reads back with this test's function as the innermost user
    frame."""
    ready, stop = threading.Event(), threading.Event()

    def helper_thread_waits():
        ready.set()
        stop.wait(10)

    thread = threading.Thread(target=helper_thread_waits, daemon=True)
    thread.start()
    ready.wait(5)
    r, w = os.pipe()
    try:
        faulthandler.dump_traceback(file=w, all_threads=True)
    finally:
        os.close(w)
        stop.set()
    with os.fdopen(r) as f:
        body = f.read()
    [dump] = parse(f"air_magic: stacks of pid 1 (the rank), on request at 00:00:00, most recent call first:\n{body}")
    functions = {t.user_frame().function for t in dump.threads if t.user_frame() is not None}
    assert {"test_a_real_faulthandler_dump_of_this_process_parses", "helper_thread_waits"} <= functions
    assert dump.user_frame().function == "test_a_real_faulthandler_dump_of_this_process_parses"


def test_a_rank_outside_its_call_is_in_no_user_code():
    """After its call returned, a rank's main thread is air_magic's own: the boot line that started it is not user
    code."""
    after = DUMP.replace(f'  File "{WORKER}", line 95 in run', f'  File "{WORKER}", line 133 in finish').replace(
        f'  File "{SITE}", line 4000 in barrier\n'
        '  File "/tmp/ipykernel_1/123.py", line 7 in waiting_for_the_slow_rank\n'
        '  File "/tmp/ipykernel_1/123.py", line 12 in train\n',
        "",
    )
    [dump] = parse(after)
    call = next(t for t in dump.threads if t.current)
    assert [f.function for f in call.frames] == ["<module>", "finish"]
    assert call.user_frame() is None and dump.user_frame().function == "fill"


def test_user_frames_are_neither_libraries_nor_air_magic():
    """Standard library, installed packages, air_magic and frozen modules are not user code; a notebook cell is."""
    assert stack_dumps.is_user_file("/tmp/ipykernel_7/2871.py")
    assert stack_dumps.is_user_file("/home/me/proj/train.py")
    assert not stack_dumps.is_user_file(SITE)
    assert not stack_dumps.is_user_file(threading.__file__)
    assert not stack_dumps.is_user_file(WORKER)
    assert not stack_dumps.is_user_file("<frozen importlib._bootstrap>")


def test_where_ranks_were_names_each_ranks_last_stop_dump(tmp_path):
    """One line per rank from its log's newest stop dump; a live request's dump and a log without one say so."""
    live = DUMP.replace(STOPPING, "on request").replace("waiting_for_the_slow_rank", "earlier_place")
    logs = [tmp_path / "rank-0.log", tmp_path / "rank-1.log"]
    logs[0].write_text("hello\n" + DUMP + live)
    logs[1].write_text("nothing\n")
    text = where_ranks_were(logs)
    assert text is not None
    assert "rank 0: in waiting_for_the_slow_rank (/tmp/ipykernel_1/123.py, line 7)" in text
    assert "earlier_place" not in text and "rank 1: no stacks" in text
    logs[0].write_text(live)
    assert where_ranks_were(logs) is None


FATAL_LOG = """\
last words of rank 0
Fatal Python error: Segmentation fault

Thread 0x00007f0a1b2c3640 (most recent call first):
  File "/site-packages/air_magic/launch/rank/steps.py", line 250 in _flush_loop
  File "/usr/lib/python3.11/threading.py", line 975 in run
  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap

Thread 0x00007f0a1c2c3640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap

Current thread 0x00007f0a2d4e5740 (most recent call first):
  File "/tmp/ipykernel_1/2.py", line 6 in dies
  File "/site-packages/air_magic/launch/rank/worker.py", line 140 in run

Extension modules: numpy.core._multiarray_umath, torch._C, torch._C._fft (total: 3)
"""


def test_a_fatal_dump_keeps_the_dying_thread_and_the_last_output_in_a_short_tail():
    """A segfault's dump is cut to its header and the thread that died, so the rank's last printed line stays within
    the tail the error shows; the other threads are counted, not listed."""
    from air_magic.launch.files.stack_dumps import compact_fatal_dump

    kept = compact_fatal_dump(FATAL_LOG.splitlines())
    assert kept[0] == "last words of rank 0" and "Fatal Python error: Segmentation fault" in kept
    assert any("in dies" in line for line in kept)
    assert not any("_flush_loop" in line or "Extension modules" in line for line in kept)
    assert kept[-1] == "(the stacks of 2 other thread(s) are in the full log)"
    assert compact_fatal_dump(["plain", "output"]) == ["plain", "output"]


def test_a_ranks_child_sharing_its_log_is_asked_even_when_reading_native_frames_outlasts_the_request(
    tmp_path, monkeypatch
):
    """py-spy's reading of a rank's native frames (up to seconds on a busy machine) is not taken from the time the
    processes after it have: the rank's DataLoader worker, which writes to the same log, still gets its turn."""
    log = tmp_path / "rank-0.log"
    log.write_text("")
    rank, child = 101, 102
    monkeypatch.setattr(stacks, "catches", lambda pid: True)
    monkeypatch.setattr(stacks, "_parent", lambda pid: rank)
    monkeypatch.setattr(
        stacks,
        "_open_target",
        lambda pid, role: stacks._Target(pid, os.open(log, os.O_WRONLY | os.O_APPEND), (1, 1), role),
    )

    def kill(pid: int, sig: int) -> None:  # each process answers at once with a dump of one frame
        with open(log, "a") as f:
            f.write(f'Thread 0x1 (most recent call first):\n  File "/user/train.py", line {pid} in step_{pid}\n')

    def slow_native(pids: list[int]) -> dict[int, str]:
        if pids:  # the rank's turn (its child is not a rank: py-spy is not run for it)
            time.sleep(stacks.REQUEST_LIMIT + 0.3)
        return {}

    monkeypatch.setattr(stacks.os, "kill", kill)
    monkeypatch.setattr(stacks, "native_stacks", slow_native)
    assert stacks.request([rank], [child], why="on request") == 2
    assert [d.pid for d in parse(log.read_text())] == [rank, child]


def test_a_request_waits_for_another_askers_dump_in_the_same_log_to_end(tmp_path, monkeypatch):
    """Another process (here another open file of the log, as a Stacks click's process has) is writing a dump into
    the rank's log: a stop's request writes its header only after that dump's trailer, however long it takes (a
    Stacks request's py-spy on a busy machine), so each dump is read under its own header with its own frames."""
    log = tmp_path / "rank-0.log"
    log.write_text("")
    frames = 'Thread 0x1 (most recent call first):\n  File "/user/train.py", line 9 in {}\n'
    other = os.open(log, os.O_WRONLY | os.O_APPEND)
    fcntl.flock(other, fcntl.LOCK_EX)
    os.write(other, b"air_magic: stacks of pid 101 (the rank), on request at 12:00:00, most recent call first:\n")

    def finish_the_other_dump() -> None:
        os.write(other, (frames.format("asked_first") + "air_magic: end of the stacks of pid 101\n").encode())
        os.close(other)

    def kill(pid: int, sig: int) -> None:
        with open(log, "a") as f:
            f.write(frames.format("stopped_here"))

    monkeypatch.setattr(stacks, "catches", lambda pid: True)
    monkeypatch.setattr(
        stacks,
        "_open_target",
        lambda pid, role: stacks._Target(pid, os.open(log, os.O_WRONLY | os.O_APPEND), (1, 1), role),
    )
    monkeypatch.setattr(stacks.os, "kill", kill)
    monkeypatch.setattr(stacks, "native_stacks", lambda pids: {})
    timer = threading.Timer(stacks.REQUEST_LIMIT + 0.5, finish_the_other_dump)  # a stop waits past a request's limit
    timer.start()
    try:
        assert stacks.request([101], why=STOPPING) == 1
    finally:
        timer.join()
    found = [(d.why, d.user_frame().function if d.user_frame() else None) for d in parse(log.read_text())]
    assert found == [("on request", "asked_first"), (STOPPING, "stopped_here")], log.read_text()
