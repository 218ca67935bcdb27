"""Security: loopback-only sockets, private files, run directories nobody else can predict, reuse or swap.

Each test ends with the leak check and the no-lost-output check that the
fault tests use.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import time
from pathlib import Path

import psutil
import pytest
from faults_common import (
    Recorder,
    assert_nothing_left,
    assert_nothing_lost,
    run_here,
)

from air_magic.errors import ConfigurationError


def loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or IPv4 loopback written as IPv6 (::ffff:127.0.0.1)."""
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]


@pytest.fixture(scope="module")
def supervised_kernel(kernel):
    """The module's kernel with `distributed` imported and its supervisor already started."""
    kernel.execute("import os, time\nfrom air_magic import distributed").check()
    kernel.execute("distributed(2, mlflow=False)(lambda: 0).distributed()").check()  # the supervisor is up
    return kernel


def inet_sockets(proc: psutil.Process) -> list:
    try:
        return proc.net_connections("inet")
    except psutil.Error:
        return []


def test_every_socket_a_run_opens_is_on_loopback_and_the_supervisor_has_none(supervised_kernel, workdir):
    """While a gloo job runs, every listening socket of its processes is on 127.0.0.1, every peer is local, and the
    supervisor uses pipes only."""
    before = {p.pid for p in psutil.process_iter()}
    kernel_listening = {
        c.laddr for c in inet_sockets(psutil.Process(supervised_kernel.pid)) if c.status == psutil.CONN_LISTEN
    }
    msg = supervised_kernel.send(
        """
@distributed(2, timeout=120)
def waits():
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} ready with {t.item()}", flush=True)
    flag = os.path.join(os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"], "go")
    while not os.path.exists(flag):
        time.sleep(0.05)
    return t.item()
print(waits.distributed())
"""
    )
    deadline = time.monotonic() + 90
    run_dir = None
    while time.monotonic() < deadline:
        ready = [
            d
            for d in (workdir / "runs").glob("*-waits-*")
            if all("ready" in _read(d / f"rank-{r}.log") for r in (0, 1))
        ]
        if ready:
            (run_dir,) = ready
            break
        time.sleep(0.2)
    assert run_dir is not None, "the job did not get ready"
    tree = psutil.Process(supervised_kernel.pid).children(recursive=True)
    listening, peers, supervisor_sockets = [], [], []
    for proc in tree:
        conns = inet_sockets(proc)
        if (
            "air_magic.launch.local.supervisor" in " ".join(proc.cmdline())
            and "AIR_MAGIC_JOB" not in _env(proc)
            and proc.ppid() == supervised_kernel.pid
        ):
            supervisor_sockets += conns
        listening += [c.laddr for c in conns if c.status == psutil.CONN_LISTEN]
        peers += [c.raddr for c in conns if c.raddr]
    kernel_after = {
        c.laddr for c in inet_sockets(psutil.Process(supervised_kernel.pid)) if c.status == psutil.CONN_LISTEN
    }
    (run_dir / "go").touch()
    out = supervised_kernel.collect(msg, timeout=60).check()
    assert "[2.0, 2.0]" in out.stdout
    assert listening, "at least the rendezvous store was listening"
    assert all(loopback(a.ip) for a in listening), listening
    assert peers and all(loopback(a.ip) for a in peers), peers
    assert supervisor_sockets == [], "the supervisor talks to the kernel over pipes, never a socket"
    assert kernel_after == kernel_listening, "the kernel itself opened no new listening socket"
    supervisor_logs = list(run_dir.parent.glob(f"supervisor-{supervised_kernel.pid}.log"))
    assert supervisor_logs and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in supervisor_logs)
    assert_nothing_left(before)
    assert_nothing_lost(run_dir, {r: [f"rank {r} ready with 2.0"] for r in (0, 1)}, out.stdout)


def _env(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except psutil.Error:
        return {}


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _leaves_every_kind_of_file(kind: str) -> object:
    import os
    import threading

    rank = int(os.environ["RANK"])
    print(f"rank {rank} {kind}", flush=True)
    if kind == "fails" and rank == 1:
        raise ValueError("an error file is written")
    if kind == "unpicklable" and rank == 0:
        return threading.Lock()
    return list(range(rank + 3))


def test_payloads_results_errors_and_logs_are_private_files_in_private_directories(tmp_path, monkeypatch):
    """Even with umask 0, the runs directory and its parents we create are 0700 and every file a run leaves is 0600."""
    cache = tmp_path / "cache"
    monkeypatch.delenv("AIR_MAGIC_RUNS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    before = {p.pid for p in psutil.process_iter()}
    old = os.umask(0)
    try:
        recs = {kind: Recorder() for kind in ("works", "fails", "unpicklable")}
        for kind, rec in recs.items():
            try:
                run_here(_leaves_every_kind_of_file, kind, listener=rec)
            except Exception as exc:  # noqa: BLE001 - the failing kinds are expected to raise
                assert kind != "works", exc
    finally:
        os.umask(old)
    root = cache / "air_magic" / "runs"
    for d in (cache, cache / "air_magic", root):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    files = []
    for kind, rec in recs.items():
        assert rec.result is not None
        run_dir = rec.result.run_dir
        assert run_dir.parent == root and stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        files += [p for p in run_dir.iterdir()]
    names = {p.name for p in files}
    assert {
        "payload.pkl",
        "job.json",
        "rank-0.log",
        "rank-0.result.pkl",
        "rank-1.error.json",
        "rank-1.error.pkl",
    } <= names
    loose = {p: oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) != 0o600}
    assert loose == {}, loose
    assert_nothing_left(before)
    # A failing rank ends the call: the other rank may be stopped before it printed (as the OS scheduled it), so
    # what must be kept is every line of the ranks that ran to their end, the failing one included.
    ran = {"works": (0, 1), "fails": (1,), "unpicklable": (0,)}
    for kind, rec in recs.items():
        assert_nothing_lost(rec.result.run_dir, {r: [f"rank {r} {kind}"] for r in ran[kind]})  # type: ignore[union-attr]


def _names_its_run_dir() -> str:
    import os

    print("rank", os.environ["RANK"], "in", os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"], flush=True)
    return os.environ["AIR_MAGIC_INTERNAL_RUN_DIR"]


def test_run_directories_are_never_reused_nor_guessable_and_shared_roots_are_refused(tmp_path, monkeypatch):
    """Each call gets a fresh 0700 directory with a random name; a runs directory others can write or own is refused
    before anything starts."""
    root = tmp_path / "runs"
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(root))
    before = {p.pid for p in psutil.process_iter()}
    first = run_here(_names_its_run_dir)
    second = run_here(_names_its_run_dir)
    a, b = Path(first.values[0]), Path(second.values[0])
    assert a != b and a.parent == b.parent == root
    for d in (a, b):
        suffix = d.name.rsplit("-", 1)[1]
        assert len(suffix) >= 8, d.name  # tempfile's random part: the name cannot be guessed in advance
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == os.getuid()

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by everyone, no sticky bit: another user could swap our run directory
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(shared))
    with pytest.raises(ConfigurationError, match="writable by other users"):
        run_here(_names_its_run_dir)
    shared.chmod(0o1777)  # like /tmp: the sticky bit stops others renaming what is ours
    assert Path(run_here(_names_its_run_dir).values[0]).parent == shared

    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)  # nobody's
    monkeypatch.setenv("AIR_MAGIC_RUNS_DIR", str(foreign))
    with pytest.raises(ConfigurationError, match="belongs to another user"):
        run_here(_names_its_run_dir)
    assert list(foreign.iterdir()) == [] and [p for p in shared.iterdir() if p.is_dir()].__len__() == 1
    assert_nothing_left(before)
    for res in (first, second):
        assert_nothing_lost(res.run_dir, {r: [f"rank {r} in {res.run_dir}"] for r in (0, 1)})
