"""What runs inside one rank's Ray actor, on whichever node Ray placed it.

Each rank is one actor in a process of its own. While it is placed it
imports the preload modules (torch) in a thread, so that import overlaps
the launcher's own work. `start` receives the pickled call through Ray (no
shared filesystem), points the process's file descriptors 1 and 2 at a log
file in a private scratch directory on its node (so C and CUDA writes are
caught too), sets the rank's environment and runs the call in a thread
through worker.run, exactly as a local rank does. The launcher then
long-polls `poll` for new output and, at the end, for the result or error
files. `dump_stacks` has the rank write where it is to its log; `interrupt`
raises KeyboardInterrupt in a session call's thread (a signal cannot reach it:
it is not the main thread), at the next Python line it runs.
`terminate` ends every process the rank started and removes the scratch
directory; the launcher then kills the actor itself. The first call of an
actor removes the scratch directories that ranks killed with their node left
on this machine (launch/files/scratch.py).

A hot actor (`RankCall.hot`) serves one call after another of the same
world in the loop a local hot rank runs (launch/rank/hot.py), the actor
being its transport: `start` hands it the next call, `poll` reports each
end. `init_process_group()` returns the group that exists and
`destroy_process_group()` keeps it (groups.py), and each call has a
scratch directory of its own.

The function runs inside the actor process (not a subprocess) so that Ray's
own API works in it: `ray.get_runtime_context().get_node_id()` names the
node of the rank. It runs in a thread of that process, not its main thread.

Ray ships this class to the nodes by value, and it imports the rest of
air_magic only inside its methods, after putting the notebook's copy of
air_magic on `sys.path` when that directory exists on the node: a cluster
on the notebook's machine (or one sharing its filesystem) runs the
notebook's own air_magic; other machines need air_magic installed, the
same version, as for any library used with Ray.

Over 300 lines because one actor class carries a rank's whole life on Ray (start, call, poll, stacks, stop,
session), which Ray gives no finer seam for.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import queue
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from air_magic.launch.files.node_mirror import Mirror
    from air_magic.launch.files.rundir import RunDir
    from air_magic.launch.protocol import ActorPlace, RankCall, RankFiles, RankReport

_CHUNK = 1 << 20
#: Seconds between two samples of what the rank uses (sent with its output).
_SAMPLE_EVERY = 1.0
#: While a call runs, how often `poll` looks for new output (the call's end is seen at once).
_OUTPUT_EVERY = 0.05


class RankActor:
    """One rank of a job, or of every call of a hot world (wrapped with `ray.remote` by the launcher)."""

    #: Seconds after a hot call before it collects garbage, if no call came (a call arriving then waits for it).
    tidy_after = 1.0

    def __init__(self, package_parent: str, preload: tuple[str, ...] = ()) -> None:
        if os.path.isdir(os.path.join(package_parent, "air_magic")) and package_parent not in sys.path:
            sys.path.insert(0, package_parent)
        self.node_path = list(sys.path)  # where this node finds ray and air_magic
        self.scratch: RunDir | None = None
        self.rank = 0
        self.code: int | None = None
        #: The last call failed in a session's user code and the rank stays usable (worker.session_kept).
        self.kept = False
        self.done = threading.Event()
        self.hot = False
        self.calls = 0
        #: A thread runs this actor's calls: a hot one waits in its loop for the next (`calls_in`).
        self.serving = False
        self.calls_in: queue.Queue[Path] = queue.Queue()
        self.next_call: Path | None = None
        from air_magic.launch.tree_usage import TreeUsage

        #: This process and its children as last sampled (cpu_percent measures from one reading to the next).
        self.trees = TreeUsage()
        self.sampled = 0.0
        self.steps_seen = 0  # the modification time of the step-times file last sent
        self.mirror: Mirror | None = None  # a command run's node files, sent back as they change
        self.mirrored = 0.0
        self.preloading = threading.Thread(target=_preload, args=(preload,), name="air_magic-preload", daemon=True)
        self.preloading.start()

    # -- placement ---------------------------------------------------------
    def where(self, port: bool = False) -> ActorPlace:
        """This actor's node id and address, process id, the GPUs Ray gave it, and a free port there if asked."""
        import ray

        from air_magic.launch.protocol import ActorPlace

        ip = ray.util.get_node_ip_address()
        return ActorPlace(
            node_id=ray.get_runtime_context().get_node_id(),
            ip=ip,
            pid=os.getpid(),
            gpus=[str(g) for g in ray.get_gpu_ids()],
            free_port=_free_port(ip) if port else 0,
        )

    # -- the rank ----------------------------------------------------------
    def start(self, call: RankCall, payload: bytes) -> int:
        """Run the call as rank `call.rank` in a thread; returns at once with this process's id."""
        import dataclasses

        from air_magic.envvars import INTERNAL_RUN_DIR
        from air_magic.launch.files import scratch as scratch_dirs
        from air_magic.launch.files.node_mirror import Mirror
        from air_magic.launch.files.rundir import RunDir, write_private

        if not self.done.is_set() and self.calls:
            raise RuntimeError("this rank's actor is still running a call")
        if self.scratch is not None:
            self.scratch.remove()  # the last call's, already reported
        elif not self.calls:
            scratch_dirs.sweep()  # what ranks of this machine left when they were killed with their node
        job = call.job
        if job.session is not None:
            from air_magic.launch.rank import interrupts

            interrupts.expect_in_thread()  # an interrupt while the call loads waits for its code (rank/interrupts.py)
        self.rank, self.code, self.kept, self.calls = call.rank, None, False, self.calls + 1
        self.done.clear()
        scratch = self.scratch = RunDir.scratch(f"{job.name}-rank{call.rank}")
        self.mirror = Mirror(scratch.path)
        write_private(scratch.payload, payload)
        here = [p for p in self.node_path if p not in job.sys_path]
        cwd = job.cwd if os.path.isdir(job.cwd) else str(scratch.path)
        spec = dataclasses.replace(job, sys_path=[*job.sys_path, *here], cwd=cwd)
        write_private(scratch.job, spec.to_bytes())
        write_private(scratch.log(call.rank), b"")
        scratch.reserve_error_record(call.rank)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        fd = os.open(scratch.log(call.rank), os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.update(call.env, **{INTERNAL_RUN_DIR: str(scratch.path)})  # on this node, the scratch is the run dir
        if self.serving:
            self.calls_in.put(scratch.path)  # the hot loop waits for it (launch/rank/hot.py)
        else:
            self.serving = True
            threading.Thread(target=self._serve, args=(call.hot,), name="air_magic-rank", daemon=True).start()
        return os.getpid()

    def _serve(self, hot: bool) -> None:
        """Run the call, and in a hot actor every next one (launch/rank/hot.py), until one ends the rank."""
        from air_magic.launch.boot import INTERNAL_ERROR
        from air_magic.launch.rank import hot as hot_rank
        from air_magic.launch.rank import worker
        from air_magic.launch.rank.groups import keep_process_group

        assert self.scratch is not None
        code, kept = INTERNAL_ERROR, False
        # two threads importing torch at once can abort the process: the call waits for the preload (it would
        # import the same modules anyway)
        self.preloading.join()
        try:
            if hot and not self.hot:
                keep_process_group()
                self.hot = True
            code = worker.run(self.scratch.path, self.rank)
            if hot:
                code = hot_rank.serve(code, self.rank, self, worker)  # returns with a call that ends the rank
            kept = code != 0 and worker.session_kept
        except BaseException:  # noqa: BLE001 - air_magic's own failure: into the rank's log
            traceback.print_exc()
        finally:
            self.serving = False  # before the end is said: a call that follows starts a thread of its own
            try:
                if hot:
                    worker.end_call()  # hooks send what they hold and let go of this call's run
                else:
                    worker.flush_hooks()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            self.report(code, kept)

    # -- the hot loop's transport (launch/rank/hot.py) ---------------------------
    def report(self, code: int, kept: bool) -> bool:
        """A call ended: `poll` hands its outcome to the launcher."""
        self.code, self.kept = code, kept
        self.done.set()
        return True

    def ready(self, timeout: float) -> bool:
        """A next call came (through `start`) within `timeout` seconds."""
        if self.next_call is None:
            with contextlib.suppress(queue.Empty):
                self.next_call = self.calls_in.get(timeout=timeout)
        return self.next_call is not None

    def take(self) -> Path:
        """The next call's scratch directory, readied by `start`."""
        path, self.next_call = self.next_call or self.calls_in.get(), None
        return path

    def poll(self, offsets: tuple[int, int, int], wait: float) -> RankReport:
        """Output, relayed MLflow lines and chart lines from the given byte offsets on (waiting up to `wait` s for
        any), and the call's files once the rank is done and everything it wrote has been read."""
        from air_magic.launch.protocol import RankReport

        assert self.scratch is not None
        files = (self.scratch.log(self.rank), self.scratch.metrics(self.rank), self.scratch.chart_metrics(self.rank))
        deadline = time.monotonic() + wait
        while True:
            finished = self.done.is_set()
            data, metrics, charts = (_read(path, at) for path, at in zip(files, offsets))
            if finished and max(len(data), len(metrics), len(charts)) < _CHUNK:
                node_files = self.node_files(final=True)
                if self.mirror is None or not self.mirror.more:
                    return RankReport(data, metrics, self.outcome(), charts, steps=self.steps(), node_files=node_files)
                return RankReport(data, metrics, charts=charts, node_files=node_files)
            if data or metrics or charts or time.monotonic() >= deadline:
                usage, steps, node_files = self.usage(), self.steps(), self.node_files()
                return RankReport(data, metrics, charts=charts, usage=usage, steps=steps, node_files=node_files)
            self.done.wait(_OUTPUT_EVERY)  # the end of the call wakes this at once

    def steps(self) -> bytes | None:
        """The rank's step-times file, when it changed since it was last sent (a few KiB, about once a second)."""
        assert self.scratch is not None
        try:
            changed = self.scratch.steps(self.rank).stat().st_mtime_ns
        except OSError:
            return None
        if changed == self.steps_seen:
            return None
        self.steps_seen = changed
        return _read_all(self.scratch.steps(self.rank))

    def node_files(self, final: bool = False) -> tuple[Any, ...]:
        """What a command run's node wrote in its run directory since it was last sent, at most once a second
        until the call ends (launch/files/node_mirror.py)."""
        if self.mirror is None or (not final and time.monotonic() - self.mirrored < _SAMPLE_EVERY):
            return ()
        self.mirrored = time.monotonic()
        return tuple(self.mirror.changes())

    def usage(self) -> tuple[float, int] | None:
        """CPU % and resident bytes of this rank (its process and every child), at most once a second."""
        if time.monotonic() - self.sampled < _SAMPLE_EVERY:
            return None
        self.sampled = time.monotonic()
        return self.trees.sample(os.getpid())

    def outcome(self) -> RankFiles:
        """The exit code and the bytes of the result or error files the rank left."""
        from air_magic.launch.protocol import RankFiles

        assert self.scratch is not None
        rd, rank = self.scratch, self.rank
        error_at = None
        with contextlib.suppress(OSError):
            error_at = rd.error(rank).stat().st_mtime_ns / 1e9
        return RankFiles(
            code=self.code,
            result=_read_all(rd.result(rank)),
            error=_read_all(rd.error(rank)),
            error_pickle=_read_all(rd.error_pickle(rank)),
            error_at=error_at,
            session_kept=self.kept,
            left={p.name: data for p in rd.carried_back(rank) if (data := _read_all(p)) is not None},
        )

    def interrupt(self) -> bool:
        """KeyboardInterrupt in the session call running now (interrupts.interrupt_call): True if raised in its user
        code now; False if kept until that code starts (it is loading the call), or if none runs."""
        from air_magic.launch.rank import interrupts

        return not self.done.is_set() and interrupts.interrupt_call()

    def request_stop(self) -> bool:
        """A Stop for the call running now: its flag in this rank's scratch directory (what should_stop reads)."""
        return self.scratch is not None and not self.done.is_set() and self.scratch.request_stop()

    def dump_stacks(self, why: str) -> int:
        """This process and its children write their threads' stacks to the rank's log (launch/stacks.py)."""
        import psutil

        from air_magic.launch.stacks import request

        return request([os.getpid()], [c.pid for c in psutil.Process().children(recursive=True)], why=why)

    def terminate(self, grace: float) -> bool:
        """End every process the rank started (SIGTERM, `grace` s, SIGKILL) and remove the scratch directory."""
        import psutil

        from air_magic.launch.stopper import stop_tree

        gone = stop_tree(lambda: psutil.Process().children(recursive=True), grace=grace, limit=5.0)
        if self.scratch is not None:
            self.scratch.remove()
        return gone


def node_ready() -> int:
    """A task that makes its node start a Ray worker for the notebook (the launcher's warm-up); its process id."""
    return os.getpid()


def installed_versions(names: list[str]) -> list[str | None]:
    """A task on one node: the version of each distribution installed there (None: not installed)."""
    import importlib.metadata

    found: list[str | None] = []
    for name in names:
        try:
            found.append(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            found.append(None)
    return found


def _preload(names: tuple[str, ...]) -> None:
    """Import what the ranks will import anyway while the launcher places them; a module missing here is no error."""
    for name in names:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _free_port(ip: str) -> int:
    """A port free on this node's address right now (MASTER_PORT, taken by rank 0's TCPStore)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def _read_all(path: Any) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _read(path: Any, offset: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(_CHUNK)
    except OSError:
        return b""
