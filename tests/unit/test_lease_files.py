"""Machine-wide leases: a unit locked by one holder is refused to another, named with its holder, and free again
once given back."""

from __future__ import annotations

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
