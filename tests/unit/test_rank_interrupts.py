"""How a session call takes an interrupt on a rank whose call runs off the main thread (a Ray actor's), with real
threads: raised in the user's code, kept while the call loads, never carried into the next call."""

from __future__ import annotations

import threading

from air_magic.launch.rank import interrupts


def test_a_call_off_the_main_thread_is_interrupted_only_while_the_users_code_runs():
    """interrupt_call raises KeyboardInterrupt in the thread inside `interruptible` (a Ray rank's call thread),
    and is a no-op once that code is done."""
    started, seen = threading.Event(), []

    def call() -> None:
        try:
            with interrupts.interruptible():
                started.set()
                while True:
                    threading.Event().wait(0.01)
        except KeyboardInterrupt:
            seen.append("interrupted")

    thread = threading.Thread(target=call)
    thread.start()
    assert started.wait(10)
    assert interrupts.interrupt_call()
    thread.join(10)
    assert seen == ["interrupted"] and not thread.is_alive()
    assert not interrupts.interrupt_call()


def test_an_interrupt_that_comes_while_a_ray_ranks_call_loads_is_raised_as_its_code_starts():
    """A Ray rank's call handed over (`expect_interrupts`) but not yet in its user code: the interrupt is kept, not
    lost, and raised as `interruptible` is entered; one that comes between calls is not kept for the next."""
    assert not interrupts.interrupt_call()  # between calls: nothing runs, nothing is kept
    interrupts.expect_in_thread()
    with interrupts.interruptible():
        ran = True  # the stray one was not carried into this call
    assert ran
    interrupts.expect_in_thread()
    assert not interrupts.interrupt_call()  # not raised now: the code has not started
    seen = []

    def call() -> None:
        try:
            with interrupts.interruptible():
                seen.append("user code ran")
        except KeyboardInterrupt:
            seen.append("interrupted")

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(10)
    assert seen == ["interrupted"]
    interrupts.expect_in_thread()
    with interrupts.interruptible():
        seen.append("next call ran")
    assert seen[-1] == "next call ran"


def test_a_local_rank_says_it_took_the_call_as_its_code_starts_and_an_early_sigint_is_raised_there(monkeypatch):
    """In the main thread: `expect` keeps a SIGINT for the call without saying "took" (the call still loads, and the
    rank's short time to come back must not count yet); `run_in_session` says "took" as the code starts, raises the
    kept SIGINT there, and ignores SIGINT again afterwards."""
    import os
    import signal

    said: list[str] = []

    class Pipes:
        def took(self) -> None:
            said.append("took")

    monkeypatch.setattr(interrupts, "pipes", Pipes())
    before = signal.getsignal(signal.SIGINT)
    try:
        interrupts.expect(session=True)
        assert said == []
        assert interrupts.run_in_session(lambda: said.append("code") or 7) == 7
        assert said == ["took", "code"]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # between calls
        interrupts.expect(session=True)
        os.kill(os.getpid(), signal.SIGINT)  # comes while the call loads: kept, not lost
        try:
            interrupts.run_in_session(lambda: said.append("ran whole"))
        except KeyboardInterrupt:
            said.append("interrupted as the code starts")
        assert said[2:] == ["took", "interrupted as the code starts"]
    finally:
        signal.signal(signal.SIGINT, before)
