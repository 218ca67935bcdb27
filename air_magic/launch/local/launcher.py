"""The local launcher: ranks on this machine, started by one supervisor process per kernel.

The supervisor (supervisor.py) runs in its own session and starts, watches
and stops the workers; this module starts it, talks to it over its
stdin/stdout pipes (protocol.py messages, one JSON line each) and turns what
it hears into the launcher events the runner reads. Each rank writes to its
log file in the run directory, the loss-free record; the job handle tails
those files into `RankOutput` events and reads each rank's result or error
file into its `RankExited`. When the kernel dies, the supervisor reads
end-of-file on stdin and stops every worker it has. Which kept pool a call runs
in, what it leaves and when one ends are decided here, in the caller's process,
by the one keeper of kept worlds (worlds.py, launch/keeper.py); the supervisor
carries them out.

Over 300 lines because the client of the helper, its restarts when stale, and each job's handle share one pipe
and its reader.
"""

from __future__ import annotations

import atexit
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from ...errors import AirMagicError, describe_returncode
from ...phase import Phase
from .. import protocol as p
from ..boot import PACKAGE_PARENT, boot_command, warm_default
from ..files.rank_files import LogTail, outcome
from ..files.rundir import RunDir, helper_log, write_private
from ..interface import ENDED_BY_USER, JobHandle, Launcher, drain
from ..keeper import RELEASED, Keeper, SessionBusy
from ..stopper import STOP_GRACE, close_by_eof
from . import worlds
from .worlds import CallWorld, LocalWorld

#: The supervisor's module: its command line names it.
SUPERVISOR_MODULE = "air_magic.launch.local.supervisor"
#: Seconds the next job waits at most for the processes of calls already over to finish exiting.
ENDING_LIMIT = STOP_GRACE + 10


class LocalJob(JobHandle):
    """One job on the supervisor: its events, with the ranks' output and outcomes read from the run directory.

    A rank that succeeded says so just before it exits, so the call can end then; the processes finish
    exiting after `close()`, and the launcher's next job waits for them (`gone`).
    """

    ends_in_background = True

    def __init__(self, launcher: LocalLauncher, request: p.JobRequest, run_dir: RunDir) -> None:
        self.launcher = launcher
        self.request = request
        self.run_dir = run_dir
        self.job_id = request.job_id
        self.wire: queue.Queue[p.Event] = queue.Queue()
        #: Set once every process of the job is gone (JobGone), or the supervisor died.
        self.gone = threading.Event()
        self.tails = [LogTail(run_dir.log(r)) for r in range(request.world_size)]
        self.client = launcher.client()
        try:
            world = worlds.take(launcher.keeper, request, self.client, self.wire.put, call_id=run_dir.path.name)
        except SessionBusy as exc:  # said as the helper would say a failed launch; nothing started
            self.world = CallWorld(launcher.keeper, None, request.world_size)
            self.wire.put(p.LaunchFailed(self.job_id, str(exc)))
            self.wire.put(p.JobGone(self.job_id))
            self.gone.set()
            return
        #: The kept world the call runs in, and what the call leaves of it.
        self.world = CallWorld(launcher.keeper, world, request.world_size)
        self.client.attach(self)
        self.client.send(launcher.launch_message(request, run_dir, world))

    def receive(self, event: p.Event) -> None:
        """An event of this job from the helper (its reader thread): what it leaves of the kept world, then queued."""
        if isinstance(event, p.RankExited):
            self.world.exited(event)
        elif isinstance(event, p.LaunchFailed):
            self.world.failed = True
        elif isinstance(event, p.LauncherDied):
            self.world.lost()
        elif isinstance(event, p.JobGone):
            self.world.gone()
        self.wire.put(event)

    # -- events ------------------------------------------------------------
    def next_events(self, timeout: float) -> list[p.Event]:
        wire = drain(self.wire, timeout)
        out: list[p.Event] = []
        for event in wire:
            if isinstance(event, p.Stale):
                self.relaunch(event.reason)  # the warm supervisor no longer matches: the same job on a fresh one
                continue
            if isinstance(event, p.RankExited):
                out += self.output(event.rank, final=True)
                event = p.RankExited(event.job, event.rank, event.returncode, event.at, self.outcome(event.rank))
            elif isinstance(event, (p.JobGone, p.LauncherDied)):
                for rank in range(len(self.tails)):
                    out += self.output(rank, final=True)
            out.append(event)
        if not any(isinstance(e, p.RankOutput) for e in out):
            for rank in range(len(self.tails)):
                out[:0] = self.output(rank)  # while running, one chunk per rank per call
        return out

    def output(self, rank: int, final: bool = False) -> list[p.Event]:
        found: list[p.Event] = []
        while True:
            text = self.tails[rank].read(final)
            if text:
                found.append(p.RankOutput(self.job_id, rank, text))
            if not (final and text):
                return found

    def outcome(self, rank: int) -> p.RankOutcome:
        """The result or the error a rank left in the run directory."""
        return outcome(self.run_dir, rank)

    def relaunch(self, why: str) -> None:
        """Start this job on a fresh supervisor; the helpers' log says why the last one was replaced."""
        self.client.note(f"replaced by a fresh helper: {why}")
        self.client.detach(self.job_id)
        old, world = self.client, self.world.world
        if world is not None:
            world.client = None  # the old helper's end of its pool is not this world's
        self.client = self.launcher.client(replace=old)
        worlds.moved(self.launcher.keeper, old, self.client, world)
        self.client.attach(self)
        self.client.send(self.launcher.launch_message(self.request, self.run_dir, world))

    # -- control -----------------------------------------------------------
    def stop(self, reason: str, grace: float, interrupt_after: float | None = None) -> None:
        try:
            self.client.send(p.StopJob(self.job_id, reason, grace, interrupt_after))
        except AirMagicError:
            pass  # the supervisor is gone, and its workers with it (LauncherDied follows)

    def dump_stacks(self) -> None:
        try:
            self.client.send(p.DumpStacks(self.job_id))
        except AirMagicError:
            pass  # the supervisor is gone (LauncherDied follows)

    def close(self) -> None:
        if self.gone.is_set():
            self.client.detach(self.job_id)
        else:
            self.launcher.ending(self)  # its processes are still exiting: the next job waits for them


class SupervisorClient:
    """One running supervisor process and the thread that reads its events."""

    def __init__(self, log_path: Path, warm: bool, keeper: Keeper) -> None:
        self.keeper = keeper
        self.log_path = log_path
        self.warm = warm
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", boot_command(SUPERVISOR_MODULE), *(["--warm"] if warm else [])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fd,
                start_new_session=True,  # a kernel interrupt must reach workers only through us
                close_fds=True,
            )
        finally:
            os.close(fd)
        self._jobs: dict[str, LocalJob] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="air_magic-supervisor-events", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def note(self, line: str) -> None:
        """Add a line of the notebook's side to this supervisor's log (where its own output goes)."""
        try:
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(f"air_magic: supervisor {self.proc.pid} {line}\n")
        except OSError:
            pass  # a log that cannot be written costs a diagnostic line, nothing more

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = p.decode(line)
            except (ValueError, TypeError):
                continue
            if isinstance(event, p.PoolEnded):
                worlds.pool_ended(self.keeper, self, event)
                continue
            with self._lock:
                job = self._jobs.get(getattr(event, "job", ""))
            if job is not None and isinstance(event, p.Event):
                job.receive(event)
                if isinstance(event, p.JobGone):
                    job.gone.set()
        with self._lock:
            jobs = list(self._jobs.values())
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        how = "" if code is None else f" ({describe_returncode(code)})"
        with self._lock:  # a retired or dead supervisor's pipes are not left for the garbage collector to close
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass
        for job in jobs:
            job.receive(
                p.LauncherDied(job.job_id, f"air_magic's supervisor process died{how}; its log: {self.log_path}")
            )
            job.gone.set()

    def send(self, message: p.Message) -> None:
        data = p.encode(message)
        with self._lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise AirMagicError(
                    f"air_magic's supervisor process is gone (its log: {self.log_path}); "
                    "the next call starts a new one."
                ) from exc

    def attach(self, job: LocalJob) -> None:
        with self._lock:
            self._jobs[job.job_id] = job

    def detach(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def retire(self) -> None:
        """Let the supervisor finish the jobs it has, then exit; new jobs go to a new one."""
        try:
            self.send(p.Retire())
        except AirMagicError:
            pass

    def close(self, timeout: float = 10.0) -> None:
        """End the supervisor; it stops whatever workers it still has first."""
        close_by_eof(self.proc, timeout, self.proc.kill)


class LocalLauncher(Launcher):
    """Ranks on this machine, through the kernel's supervisor (started on first use, again if it died)."""

    supports = frozenset({"keep_alive", "warm", "session", "debug"})

    def __init__(self, keeper: Keeper) -> None:
        #: The keeper of kept worlds of the process that makes calls (its owner's).
        self.keeper = keeper
        self._client: SupervisorClient | None = None
        self._lock = threading.Lock()
        self._ending: list[LocalJob] = []  # jobs whose call ended while their processes still exit
        atexit.register(self.shutdown)

    def ending(self, job: LocalJob) -> None:
        """`job`'s call is over but its processes are still exiting: the next job waits for them."""
        with self._lock:
            self._ending.append(job)

    def wait_ended(self, limit: float = ENDING_LIMIT) -> None:
        """Wait (at most `limit` s) until every process of the jobs whose calls are over is gone."""
        deadline = time.monotonic() + limit
        with self._lock:
            jobs, self._ending = self._ending, []
        for job in jobs:
            job.gone.wait(max(0.0, deadline - time.monotonic()))
            job.client.detach(job.job_id)

    def client(self, replace: SupervisorClient | None = None) -> SupervisorClient:
        """The supervisor, started on first use, again if it died, or anew when `replace` went stale."""
        with self._lock:
            if replace is not None and self._client is replace:
                replace.retire()
                self._client = None
            if self._client is None or not self._client.alive:
                self._client = SupervisorClient(helper_log("supervisor", os.getpid()), warm_default(), self.keeper)
            return self._client

    def prepare(self) -> Phase | None:
        """Start the supervisor now if there is none: it imports torch while the MLflow run is made."""
        fresh = self.supervisor_pid is None
        self.client()
        return Phase.STARTING_HELPER if fresh else None

    @property
    def supervisor_pid(self) -> int | None:
        """The running supervisor's pid, if there is one."""
        client = self._client
        return client.proc.pid if client is not None and client.alive else None

    def launch_message(self, request: p.JobRequest, run_dir: RunDir, world: LocalWorld | None = None) -> p.LaunchJob:
        # hot ranks are forks of the warm helper, whatever `warm` says
        fork = bool(request.keep_alive) or (warm_default() if request.warm is None else request.warm)
        return p.LaunchJob(
            job=request.job_id,
            world_size=request.world_size,
            fork=fork,
            executable=sys.executable,
            sys_path=request.sys_path,
            run_dir=str(run_dir.path),
            env=request.env,
            package_parent=PACKAGE_PARENT,
            keep_alive=request.keep_alive,
            world_key=request.world_key,
            hooks=list(request.hooks),
            restart_count=request.restart_count,
            max_restarts=request.max_restarts,
            session=request.session,
            pool=world.pool if world is not None else None,
        )

    def start(self, request: p.JobRequest, run_dir: RunDir) -> LocalJob:
        self.wait_ended()  # the last call's ranks finish exiting before this one starts
        try:
            write_private(run_dir.payload, request.payload)
            write_private(run_dir.job, p.JobFile.of(request).to_bytes())
        except OSError as exc:
            raise run_dir.write_failed(exc) from exc
        return LocalJob(self, request, run_dir)

    def prepare_hooks(self, hooks: list[str], env: dict[str, str]) -> None:
        """Have the running warm supervisor, if there is one, run these hooks' `preload(env)` in the background."""
        client = self._client
        if client is not None and client.warm and client.alive:
            try:
                client.send(p.PrepareHooks(list(hooks), dict(env)))
            except AirMagicError:
                pass  # it is gone; the next call starts a new one, and prepares it after that call

    def release_hot(self) -> None:
        """End every idle hot rank now (a running call's ranks end with it)."""
        self.wait_ended()  # a call that just returned still holds its hot ranks until its end is confirmed
        self.keeper.release_idle(RELEASED, kind=LocalWorld)

    def end_session(self, name: str, why: str = ENDED_BY_USER) -> None:
        """End session `name`'s ranks now, if they are kept, saying `why` (a call running in them is stopped)."""
        self.wait_ended()
        world = self.keeper.session(name, LocalWorld)
        if world is not None:
            self.keeper.release(world, why)

    def shutdown(self) -> None:
        """Stop the supervisor and everything it runs (at exit, or on %unload_ext)."""
        with self._lock:
            client, self._client = self._client, None
        self.keeper.end_all("the kernel shut down", say=False, kind=LocalWorld)
        if client is not None:
            client.close()
