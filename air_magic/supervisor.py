"""The supervisor process: starts each job's workers, stops whole process trees, reports exits.

One per kernel, started by launcher.py in its own session. It reads requests
on stdin and writes events on stdout, one JSON object a line. It is a child
subreaper, so processes a worker leaves behind are re-parented here and can
still be found and ended. It never imports IPython; it imports torch only to
host each job's rendezvous store on 127.0.0.1 (so no rank listens on another
interface). Policy (when to stop a job) belongs to the runner; this process
carries it out.

End-of-file on stdin means the kernel is gone: every job is stopped and the
supervisor exits.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psutil

_PR_SET_CHILD_SUBREAPER = 36
_WORKER_BOOT = "import sys; sys.path.insert(0, {parent!r}); from air_magic.worker import main; main()"
_TICK = 0.1


@dataclass
class Job:
    """One call's workers as the supervisor tracks them."""

    id: str
    world_size: int
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    exited: dict[int, int] = field(default_factory=dict)  # rank -> return code
    kill_at: float | None = None
    grace: float = 3.0
    store: Any = None
    store_fd: int | None = None
    seen: dict[int, psutil.Process] = field(default_factory=dict)

    @property
    def live_workers(self) -> list[int]:
        return [pid for rank, pid in self.pids.items() if rank not in self.exited]


def _emit(event: dict[str, Any]) -> None:
    try:
        os.write(1, (json.dumps(event) + "\n").encode())
    except BrokenPipeError:
        pass  # the kernel is gone; stdin EOF follows and stops everything


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _serve_store(job: Job, port: int, fd: int) -> None:
    """Host the job's TCPStore on the socket bound to 127.0.0.1 (imports torch: run in a thread)."""
    try:
        from torch.distributed import TCPStore

        job.store = TCPStore(
            "127.0.0.1", port, job.world_size, True,
            timedelta(minutes=30), wait_for_workers=False,
            master_listen_fd=fd, use_libuv=False,
        )
    except Exception as exc:  # noqa: BLE001 - ranks will report the rendezvous failure
        print(f"air_magic supervisor: store for job {job.id} failed: {exc!r}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.owner: dict[int, tuple[str, int]] = {}  # worker pid -> (job, rank)
        self.parent = os.getppid()
        self.closing = False

    # -- requests ----------------------------------------------------------
    def handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "launch":
            try:
                self.launch(msg)
            except Exception as exc:  # noqa: BLE001 - reported to the runner
                _emit({"job": msg["job"], "event": "error", "message": f"{type(exc).__name__}: {exc}"})
                job = self.jobs.get(msg["job"])
                if job is not None:
                    self.stop(job, 0.0)
                else:
                    _emit({"job": msg["job"], "event": "finished"})
        elif op == "stop":
            job = self.jobs.get(msg["job"])
            if job is not None:
                self.stop(job, float(msg.get("grace", 3.0)))

    def launch(self, msg: dict[str, Any]) -> None:
        job = Job(msg["job"], int(msg["world_size"]))
        self.jobs[job.id] = job
        env = dict(msg["env"])
        have_torch = importlib.util.find_spec("torch") is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        if have_torch:
            sock.listen(max(128, 4 * job.world_size))
            job.store_fd = sock.detach()  # the store owns the descriptor from now on
            threading.Thread(target=_serve_store, args=(job, port, job.store_fd), daemon=True).start()
            env.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        else:
            sock.close()
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(job.world_size),
            LOCAL_WORLD_SIZE=str(job.world_size), NODE_RANK="0", GROUP_RANK="0",
            AIR_MAGIC_JOB=job.id, AIR_MAGIC_SUPERVISOR_PID=str(os.getpid()),
        )
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        boot = _WORKER_BOOT.format(parent=msg["package_parent"])
        for rank in range(job.world_size):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank))
            log = msg["logs"][rank]
            pid = os.posix_spawn(
                msg["executable"],
                [msg["executable"], "-c", boot, msg["run_dir"], str(rank)],
                rank_env,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 1, log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
                    (os.POSIX_SPAWN_DUP2, 1, 2),
                ],
                setsid=True,
                setsigdef=(signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD),
            )
            job.pids[rank] = pid
            self.owner[pid] = (job.id, rank)
            _emit({"job": job.id, "event": "started", "rank": rank, "pid": pid, "port": port})

    # -- process trees -----------------------------------------------------
    def processes(self, job: Job) -> dict[int, psutil.Process]:
        """Every live process of the job: workers, their descendants, and adopted orphans."""
        found: dict[int, psutil.Process] = {}
        for pid in job.live_workers:
            try:
                p = psutil.Process(pid)
                found[pid] = p
                found.update((c.pid, c) for c in p.children(recursive=True))
            except psutil.Error:
                pass
        try:
            mine = psutil.Process().children(recursive=True)
        except psutil.Error:
            mine = []
        for c in mine:
            if c.pid in found or c.pid in self.owner:
                continue
            try:
                if c.environ().get("AIR_MAGIC_JOB") == job.id or c.pid in job.seen:
                    found[c.pid] = c
            except psutil.Error:
                pass
        for pid, p in list(found.items()):
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    del found[pid]
            except psutil.Error:
                del found[pid]
        job.seen.update(found)
        return found

    def signal_job(self, job: Job, sig: int) -> None:
        procs = self.processes(job)
        for pid in job.live_workers:
            try:
                os.killpg(pid, sig)  # the worker leads its own group: DataLoader workers are in it
            except OSError:
                pass
        for p in procs.values():
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def stop(self, job: Job, grace: float) -> None:
        if job.kill_at is None:
            job.grace = grace
            job.kill_at = time.monotonic() + grace
            self.signal_job(job, signal.SIGTERM)

    # -- the loop ----------------------------------------------------------
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            owner = self.owner.pop(pid, None)
            if owner is None:
                continue  # an adopted orphan
            job = self.jobs.get(owner[0])
            if job is not None:
                code = os.waitstatus_to_exitcode(status)
                job.exited[owner[1]] = code
                _emit({"job": job.id, "event": "exited", "rank": owner[1], "returncode": code})

    def tick(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if job.kill_at is not None and now >= job.kill_at:
                self.signal_job(job, signal.SIGKILL)
                job.kill_at = now + _TICK
            if len(job.exited) < len(job.pids) or len(job.pids) < job.world_size and job.kill_at is None:
                continue
            leftovers = self.processes(job)
            if leftovers and job.kill_at is None:
                self.stop(job, job.grace)  # a finished job's stray children get TERM, then KILL
                continue
            if not leftovers:
                job.store = None
                del self.jobs[job.id]
                _emit({"job": job.id, "event": "finished"})

    def run(self) -> None:
        _become_subreaper()
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self.close())
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        buf = b""
        while not (self.closing and not self.jobs):
            ready, _, _ = select.select([0, rfd] if not self.closing else [rfd], [], [], _TICK)
            if rfd in ready:
                os.read(rfd, 4096)
            if 0 in ready:
                chunk = os.read(0, 65536)
                if not chunk:
                    self.close()
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        self.handle(json.loads(line))
            if os.getppid() != self.parent:
                self.close()
            self.reap()
            self.tick()

    def close(self) -> None:
        """The kernel is gone or asked us to go: stop every job, then leave."""
        self.closing = True
        for job in self.jobs.values():
            self.stop(job, 1.0)


def main() -> None:
    Supervisor().run()
