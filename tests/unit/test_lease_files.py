"""Machine-wide leases: a unit locked by one holder is refused to another, named with its holder, and free again
once given back."""

from __future__ import annotations

import os

from air_magic.calls.leases import Leases
from air_magic.calls.ledger import CPU, GPU, Ledger


def test_two_ledgers_on_one_lease_directory_never_share_a_unit(tmp_path):
    """Two ledgers (as two processes would be) sharing the lock files: the second waits for the first's slots."""
    first = Ledger([], cpu_slots=2, leases=Leases(tmp_path))
    second = Ledger([], cpu_slots=2, leases=Leases(tmp_path))
    assert first.take("call a", 2, CPU, "call a (train)") == ("0", "1")
    assert second.take("call b", 1, CPU, "call b (eval)") is None
    assert second.why_waiting(1, CPU).startswith("1 CPU slot(s); 0 of 2 free, held by call a (train) (kernel pid ")
    first.give_back("call a")
    assert second.take("call b", 1, CPU, "call b (eval)") == ("0",)


def test_a_gpu_held_elsewhere_is_skipped_for_a_free_one(tmp_path):
    """GPU 0 held by another holder: a call of one GPU gets GPU 1."""
    first = Ledger(["0", "1"], cpu_slots=1, leases=Leases(tmp_path))
    second = Ledger(["0", "1"], cpu_slots=1, leases=Leases(tmp_path))
    assert first.take("a", 1, GPU) == ("0",)
    assert second.take("b", 1, GPU) == ("1",)
    assert list(second.elsewhere(GPU)) == ["0"] and second.elsewhere(GPU)["0"].startswith("a (kernel pid ")


def test_the_lock_files_are_private(tmp_path):
    """The lock and holder files are 0600: another user can neither read who holds what nor take a lease."""
    Ledger([], cpu_slots=1, leases=Leases(tmp_path)).take("a", 1, CPU, "call a")
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"cpu-0.lock": 0o600, "cpu-0.holder": 0o600}


def test_the_holder_is_named_by_its_owners_role_as_it_is_now(tmp_path):
    """The lease files name the holding process by its owner's role, read when a unit is taken: a process that became
    a command-line run after its ledger was made is named "cli"."""
    role = ["kernel"]
    first = Ledger([], cpu_slots=2, leases=Leases(tmp_path, lambda: role[0]))
    second = Ledger([], cpu_slots=2, leases=Leases(tmp_path))
    first.take("a", 1, CPU, "call a")
    role[0] = "cli"
    first.take("b", 1, CPU, "call b")
    assert sorted(second.elsewhere(CPU).values()) == [
        f"call a (kernel pid {os.getpid()})",
        f"call b (cli pid {os.getpid()})",
    ]
