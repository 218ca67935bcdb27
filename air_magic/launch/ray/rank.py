"""What runs inside one rank's Ray actor, on whichever node Ray placed it.

Each rank is one actor in a process of its own. `start` receives the pickled
call through Ray (no shared filesystem), points the process's file
descriptors 1 and 2 at a log file in a private scratch directory on its node
(so C and CUDA writes are caught too), sets the rank's environment and runs
the call in a thread through worker.run, exactly as a local rank does. The
launcher then long-polls `poll` for new output and, at the end, for the
result or error files. `dump_stacks` has the rank write where it is to its
log. `terminate` ends every process the rank started and removes the scratch
directory; the launcher then kills the actor itself.

The function runs inside the actor process (not a subprocess) so that Ray's
own API works in it: `ray.get_runtime_context().get_node_id()` names the
node of the rank. It runs in a thread of that process, not its main thread.

Ray ships this class to the nodes by value, and it imports the rest of
air_magic only inside its methods, after putting the notebook's copy of
air_magic on `sys.path` when that directory exists on the node: a cluster
on the notebook's machine (or one sharing its filesystem) runs the
notebook's own air_magic; other machines need air_magic installed, the
same version, as for any library used with Ray.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from air_magic.launch.protocol import JobFile
    from air_magic.launch.rundir import RunDir

_CHUNK = 1 << 20


class RankActor:
    """One rank of a job (wrapped with `ray.remote` by the launcher)."""

    def __init__(self, package_parent: str) -> None:
        if os.path.isdir(os.path.join(package_parent, "air_magic")) and package_parent not in sys.path:
            sys.path.insert(0, package_parent)
        self.scratch: RunDir | None = None
        self.rank = 0
        self.code: int | None = None
        self.done = threading.Event()

    # -- placement ---------------------------------------------------------
    def where(self) -> dict[str, Any]:
        """This actor's node id and address, process id and the GPUs Ray gave it."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "host": socket.gethostname(),
        }

    def free_port(self, ip: str) -> int:
        """A port free on this node's address right now (MASTER_PORT, taken by rank 0's TCPStore)."""
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return int(s.getsockname()[1])

    # -- the rank ----------------------------------------------------------
    def start(self, rank: int, payload: bytes, job: JobFile, env: dict[str, str]) -> int:
        """Run the call as rank `rank` in a thread; returns at once with this process's id."""
        import dataclasses

        from air_magic.launch.rundir import RunDir, write_private

        self.rank = rank
        scratch = self.scratch = RunDir.scratch(f"{job.name}-rank{rank}")
        write_private(scratch.payload, payload)
        here = [p for p in sys.path if p not in job.sys_path]  # where this node finds ray and air_magic
        cwd = job.cwd if os.path.isdir(job.cwd) else str(scratch.path)
        spec = dataclasses.replace(job, sys_path=[*job.sys_path, *here], cwd=cwd)
        write_private(scratch.job, spec.to_bytes())
        write_private(scratch.log(rank), b"")
        scratch.reserve_error_record(rank)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        fd = os.open(scratch.log(rank), os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.update(env, AIR_MAGIC_RUN_DIR=str(scratch.path))  # on this node, the scratch is the run directory
        threading.Thread(target=self._run, name="air_magic-rank", daemon=True).start()
        return os.getpid()

    def _run(self) -> None:
        from air_magic.launch import worker

        assert self.scratch is not None
        code = 70
        try:
            code = worker.run(self.scratch.path, self.rank)
        except BaseException:  # noqa: BLE001 - air_magic's own failure: into the rank's log
            traceback.print_exc()
        finally:
            try:
                worker.flush_hooks()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            self.code = code
            self.done.set()

    def poll(self, offset: int, metrics_offset: int, wait: float) -> tuple[bytes, bytes, dict[str, Any] | None]:
        """Output and relayed MLflow lines from the given byte offsets on (waiting up to `wait` s for output),
        and the outcome once the rank is done and everything it wrote has been read."""
        assert self.scratch is not None
        deadline = time.monotonic() + wait
        while True:
            finished = self.done.is_set()
            data = _read(self.scratch.log(self.rank), offset)
            metrics = _read(self.scratch.metrics(self.rank), metrics_offset)
            if finished and len(data) < _CHUNK and len(metrics) < _CHUNK:
                return data, metrics, self.outcome()
            if data or metrics or time.monotonic() >= deadline:
                return data, metrics, None
            self.done.wait(0.05)

    def outcome(self) -> dict[str, Any]:
        """The exit code and the bytes of the result or error files the rank left."""
        assert self.scratch is not None
        out: dict[str, Any] = {"code": self.code}
        for key, path in (
            ("result", self.scratch.result(self.rank)),
            ("error", self.scratch.error(self.rank)),
            ("error_pickle", self.scratch.error_pickle(self.rank)),
        ):
            try:
                out[key] = path.read_bytes()
                if key == "error":
                    out["error_at"] = path.stat().st_mtime_ns / 1e9
            except OSError:
                out[key] = None
        return out

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
            shutil.rmtree(self.scratch.path, ignore_errors=True)
        return gone


def _read(path: Any, offset: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(_CHUNK)
    except OSError:
        return b""
