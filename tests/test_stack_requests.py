"""Asking a live process for its stacks (air_magic/launch/stacks.py): real processes, a real signal."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_until

from air_magic.launch import stacks
from air_magic.launch.files.stack_dumps import parse
from air_magic.launch.stacks import STOPPING

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


#: The child answers SIGRTMAX with "pong" in its log: a signal sent after STACKS_SIGNAL is handled after it (Linux
#: delivers pending real-time signals lowest number first), so a pong proves an earlier STACKS_SIGNAL would be handled.
_CHILD = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from air_magic.launch import stacks
signal.signal(signal.SIGRTMAX, lambda *_: print("pong", flush=True))
if {install}:
    stacks.install()
def stuck_in_data_loading():
    print("ready", flush=True)
    time.sleep(60)
if {fork} and os.fork() == 0:
    def in_a_forked_child():
        time.sleep(60)
    in_a_forked_child()
stuck_in_data_loading()
"""


def _start(tmp_path: Path, install: bool, fork: bool = False) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "rank-0.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    code = _CHILD.format(root=str(ROOT), install=install, fork=fork)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=fd, stderr=fd, start_new_session=True)
    os.close(fd)
    wait_until(lambda: "ready" in log.read_text() or proc.poll() is not None, 30, "the child never got ready")
    assert proc.poll() is None, log.read_text()
    return proc, log


@pytest.mark.skipif(stacks.STACKS_SIGNAL is None, reason="no real-time signals here")
def test_a_request_writes_the_stacks_of_a_process_and_its_forked_child_in_turn(tmp_path):
    """A rank blocked in time.sleep and the child it forked each write a whole dump to the shared log; both live on;
    a second stop request right away is not sent, live requests always are."""
    proc, log = _start(tmp_path, install=True, fork=True)
    try:
        import psutil

        children = [c.pid for c in psutil.Process(proc.pid).children()]
        assert stacks.request([proc.pid], children, why=STOPPING) == 2
        dumps = parse(log.read_text())
        assert [d.of_rank for d in dumps] == [True, False]
        assert dumps[0].user_frame().function == "stuck_in_data_loading"
        assert dumps[1].user_frame().function == "in_a_forked_child" and f"child of pid {proc.pid}" in dumps[1].role
        assert proc.poll() is None and all(psutil.pid_exists(c) for c in children)
        assert stacks.request([proc.pid], why=STOPPING) == 0, "the same stop heard twice is answered once"
        assert stacks.request([proc.pid]) == stacks.request([proc.pid]) == 1, "each live request is answered"
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.skipif(stacks.STACKS_SIGNAL is None, reason="no real-time signals here")
def test_a_stop_heard_again_seconds_later_does_not_dump_the_same_process_twice(tmp_path):
    """A stop that also releases the hot ranks it stops asks twice; on a busy machine 3 s apart, and the second
    dump, of a rank already ending, was empty and was read as where it stopped ("in no user code"). The same
    process is asked once per stop however late the second ask comes; another process under a remembered pid is
    asked."""
    import time

    proc, log = _start(tmp_path, install=True)
    try:
        assert stacks.request([proc.pid], why=STOPPING) == 1
        time.sleep(2.5)  # past the 2 s that used to tell one stop heard twice from two stops
        assert stacks.request([proc.pid], why=STOPPING) == 0
        _, at = stacks._recent[proc.pid]
        stacks._recent[proc.pid] = ("another process", at)  # as if the pid had been taken by a new process
        assert stacks.request([proc.pid], why=STOPPING) == 1
        assert [d.why for d in parse(log.read_text())] == [STOPPING, STOPPING]
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.skipif(stacks.STACKS_SIGNAL is None, reason="no real-time signals here")
def test_a_process_that_does_not_answer_the_signal_is_never_sent_it(tmp_path):
    """A process without the handler (to which the signal would be fatal) is left alone, and its log untouched."""
    proc, log = _start(tmp_path, install=False)
    try:
        before = log.read_text()
        assert stacks.request([proc.pid]) == 0
        os.kill(proc.pid, signal.SIGRTMAX)  # handled after any STACKS_SIGNAL the request could have sent
        wait_until(lambda: "pong" in log.read_text() or proc.poll() is not None, 30, "the child never answered")
        assert proc.poll() is None and log.read_text() == before + "pong\n"
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


#: A stand-in py-spy that does what a slow one does to the process it reads, for ever: stops it and never answers.
_FROZEN_PY_SPY = """#!/bin/sh
touch "$AIR_MAGIC_TEST_MARKER"
kill -STOP "$4"
exec sleep 600
"""

_ASKS_ITSELF = """
import os, sys, threading, time
sys.path.insert(0, {root!r})
from air_magic.launch import native_frames, stacks
native_frames.NATIVE_LIMIT = 1.0
stacks.install()
def stop():
    while not os.path.exists(os.environ["AIR_MAGIC_TEST_MARKER"]):  # the request is in py-spy: stop now
        time.sleep(0.01)
    stacks.request([os.getpid()], why=stacks.STOPPING)
def waiting_for_the_slow_rank():  # as a Ray rank's actor does, each ask in a thread of its own
    askers = [threading.Thread(target=stacks.request, args=([os.getpid()],)), threading.Thread(target=stop)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
waiting_for_the_slow_rank()
print("both asked", flush=True)
"""


@pytest.mark.skipif(stacks.STACKS_SIGNAL is None, reason="no real-time signals here")
def test_a_rank_that_asks_itself_is_let_go_by_a_py_spy_that_never_answers_and_still_writes_the_stop_dump(tmp_path):
    """A Ray rank answers a Stacks request itself, and py-spy stops the process it reads: one that never answers
    is ended at its limit by a watchdog outside the rank, which goes on; a stop that came meanwhile writes its own
    dump after the request's, each saying why its native frames are missing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "py-spy").write_text(_FROZEN_PY_SPY)
    (bin_dir / "py-spy").chmod(0o755)
    log = tmp_path / "rank-1.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["AIR_MAGIC_TEST_MARKER"] = str(tmp_path / "py-spy-started")
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _ASKS_ITSELF.format(root=str(ROOT))],
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
        )
    try:
        proc.wait(timeout=120)  # without the watchdog the rank stays stopped for ever
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        pytest.fail(f"the rank was never let go by py-spy: {log.read_text()}")
    text = log.read_text()
    assert proc.returncode == 0 and "both asked" in text, text
    dumps = parse(text)
    assert [d.why for d in dumps] == ["on request", STOPPING], text
    for dump in dumps:
        assert "in waiting_for_the_slow_rank" in dump.text(), text
        assert dump.native == [] and "py-spy did not answer within 1 s" in (dump.native_note or ""), text
    assert text.count("air_magic: end of the stacks of pid") == 2, text


#: A process that answers STACKS_SIGNAL as faulthandler does, but is kept from running for 80 ms between its first
#: thread and the thread running the call, as a busy machine's scheduler does.
_PAUSED_MIDWAY = """
import signal, sys, time
def answer(*_):
    sys.stderr.write('Thread 0x0000000000000001 (most recent call first):\\n'
                     '  File "/x/prefetch.py", line 9 in fill\\n\\n')
    sys.stderr.flush()
    time.sleep(0.08)
    sys.stderr.write('Current thread 0x0000000000000002 (most recent call first):\\n'
                     '  File "/x/train.py", line 7 in waiting_for_the_slow_rank\\n')
    sys.stderr.flush()
signal.signal({sig}, answer)
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""


@pytest.mark.skipif(stacks.STACKS_SIGNAL is None, reason="no real-time signals here")
def test_on_a_busy_machine_a_dump_paused_midway_is_read_whole(tmp_path, monkeypatch):
    """At a load of 6 a core, a rank's dump is waited for until its log has not grown for 6 x 15 ms: a dump whose
    writer lost 80 ms to the scheduler between two threads is read whole, its call's thread included."""
    code = _PAUSED_MIDWAY.format(sig=int(stacks.STACKS_SIGNAL))
    _read_whole([sys.executable, "-c", code], tmp_path / "rank-0.log", 6.0, monkeypatch)


def _read_whole(command: list[str], log: Path, load: float, monkeypatch) -> None:
    """Start `command` (its output into `log`), ask it for its stacks at a load of `load` a core, and check that the
    dump read holds the call's thread, before the trailer."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    proc = subprocess.Popen(command, stdout=fd, stderr=fd, start_new_session=True)
    os.close(fd)
    monkeypatch.setattr(stacks, "patience", lambda: load)
    monkeypatch.setattr(stacks, "native_stacks", lambda pids: {})
    try:
        wait_until(lambda: "ready" in log.read_text() or proc.poll() is not None, 30, "the child never got ready")
        assert stacks.request([proc.pid], why=STOPPING) == 1
        [dump] = parse(log.read_text())
        frame = dump.user_frame()
        assert frame is not None and frame.function == "waiting_for_the_slow_rank", log.read_text()
        assert log.read_text().rstrip().endswith(f"air_magic: end of the stacks of pid {proc.pid}"), log.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


#: A process whose handler of STACKS_SIGNAL is C code installed as faulthandler installs its own (no SA_NODEFER),
#: and that stops for 300 ms between its first thread and the thread running the call: a rank's dump on a machine
#: whose scheduler keeps the signal's thread waiting longer than any quiet time the asker could wait for.
_C_HANDLER = r"""
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static void put(const char *s) { (void)!write(2, s, strlen(s)); }
static void answer(int sig) {
    struct timespec paused = {0, 300000000};
    (void)sig;
    put("Thread 0x0000000000000001 (most recent call first):\n  File \"/x/prefetch.py\", line 9 in fill\n\n");
    nanosleep(&paused, NULL);
    put("Current thread 0x0000000000000002 (most recent call first):\n"
        "  File \"/x/train.py\", line 7 in waiting_for_the_slow_rank\n");
}
int main(void) {
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_handler = answer;
    sigemptyset(&act.sa_mask);
    act.sa_flags = SA_RESTART;
    sigaction(SIGRTMIN + 6, &act, NULL);
    put("ready\n");
    for (;;) pause();
}
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the handler's state is read from Linux's /proc")
def test_a_dump_is_read_when_the_handler_has_returned_however_long_it_is_kept_from_running(tmp_path, monkeypatch):
    """A dump whose writer is kept from running for 300 ms midway, 20 times the quiet time the asker waits for on an
    idle machine, is read whole: the asker waits while the handler runs (the signal blocked in its thread)."""
    compiler = next((c for c in ("cc", "gcc") if shutil.which(c)), None)
    if compiler is None:
        pytest.skip("no C compiler to build the process's handler")
    assert stacks.STACKS_SIGNAL == signal.SIGRTMIN + 6  # the signal the C program answers
    source, program = tmp_path / "answer.c", tmp_path / "answer"
    source.write_text(_C_HANDLER)
    subprocess.run([compiler, "-O1", "-o", str(program), str(source)], check=True, capture_output=True)
    _read_whole([str(program)], tmp_path / "rank-0.log", 1.0, monkeypatch)
