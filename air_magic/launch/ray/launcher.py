"""The Ray launcher: the ranks of a call as Ray actors on several machines, behind the same Launcher interface.

For N nodes with k ranks each, a placement group of N bundles (k CPUs, and k
GPUs for GPU ranks) is asked for with STRICT_SPREAD, so each bundle is a
different machine and nothing starts until all of them are reserved. Rank r
is actor r % k of bundle r // k: ranks are ordered by node, then local rank.
Rank 0's node gives MASTER_ADDR and a free MASTER_PORT, so an unchanged
`init_process_group()` meets there. The pickled call travels through Ray's
object store.

A thread per job (the pump) does every blocking Ray call: it places the job,
starts the ranks, long-polls each actor for output (written to the rank's log
in the run directory here, the full record, and reported as `RankOutput`)
and for its outcome, and tears everything down: the ranks' own child
processes, the actors, the placement group. A rank whose actor or node dies
is reported as a `WorkerDiedError`. The runner sees only the events.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ...errors import WorkerDiedError
from .. import protocol as p
from ..env import loopback_sockets, torchrun_env
from ..errorfile import read_error_file
from ..interface import JobHandle, Launcher, drain
from ..rundir import RunDir, write_private
from .cluster import alive_nodes, require_connected
from .rank import RankActor

_PKG_PARENT = str(Path(__file__).resolve().parents[3])
#: How long a placement the cluster could hold may wait for resources that are busy, in seconds.
PLACEMENT_WAIT = 45.0
#: How long the actors of a placed job may take to start, in seconds (a busy node takes long to start Ray workers).
START_WAIT = 300.0
#: Seconds an actor's poll waits for new output before it answers with none.
POLL_WAIT = 0.5
#: Variables of the notebook that describe its own machine, not the ranks' machines.
NODE_LOCAL_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_"})


class LaunchError(Exception):
    """The job cannot be placed or started; the message says why."""


class _Stopped(Exception):
    """A stop came while the job was being placed or started."""


def _rank_env(request: p.JobRequest) -> dict[str, str]:
    return {
        k: v for k, v in request.env.items()
        if k not in NODE_LOCAL_ENV and not k.startswith("RAY_") and k != "RAYLET_PID"
    }


def _resources(res: dict[str, float], keys: tuple[str, ...]) -> str:
    return ", ".join(f"{res.get(k, 0):g} {k}" for k in keys)


class RayJob(JobHandle):
    """One job on the cluster: its pump thread and the events it reports."""

    def __init__(self, launcher: RayLauncher, request: p.JobRequest, run_dir: RunDir, ray: Any) -> None:
        self.launcher = launcher
        self.request = request
        self.run_dir = run_dir
        self.ray = ray
        self.job = request.job_id
        self.per_node = request.world_size // request.num_nodes
        self.events: queue.Queue[p.Event] = queue.Queue()
        self.stop_asked = threading.Event()
        self.grace = 3.0
        self.actors: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.pg: Any = None
        self.started: set[int] = set()
        self.exited: set[int] = set()
        self.decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(request.world_size)]
        self.offsets = [0] * request.world_size
        self.metrics_offsets = [0] * request.world_size
        self.thread = threading.Thread(target=self._pump, name=f"air_magic-ray-{self.job[:8]}", daemon=True)
        self.thread.start()

    # -- the JobHandle side (the runner's thread) ---------------------------
    def next_events(self, timeout: float) -> list[p.Event]:
        return drain(self.events, timeout)

    def stop(self, reason: str, grace: float) -> None:
        self.grace = grace
        self.stop_asked.set()

    def close(self) -> None:
        self.stop_asked.set()  # a no-op after JobGone; otherwise the pump tears down and ends alone
        self.launcher.forget(self)

    def dump_stacks(self) -> None:
        for rank in sorted(self.started - self.exited):
            with contextlib.suppress(Exception):
                self.actors[rank].dump_stacks.remote("on request")  # arrives with the rank's next output

    # -- the pump (its own thread) ------------------------------------------
    def _pump(self) -> None:
        try:
            self._place()
            self._start_ranks()
            self._watch()
        except _Stopped:
            pass
        except LaunchError as exc:
            self.events.put(p.LaunchFailed(self.job, str(exc)))
        except Exception as exc:  # noqa: BLE001 - reported to the runner, never raised in a thread
            self.events.put(p.LaunchFailed(self.job, f"the Ray launcher failed: {type(exc).__name__}: {exc}"))
        finally:
            try:
                self._teardown()
            except Exception as exc:  # noqa: BLE001
                self.events.put(p.LaunchFailed(self.job, f"tearing the job down failed: {type(exc).__name__}: {exc}"))
            for rank in sorted(self.started - self.exited):
                self._flush_decoder(rank)
                self.events.put(p.RankExited(self.job, rank, -signal.SIGKILL, time.time()))
            self.events.put(p.JobGone(self.job))

    def _wait(self, refs: list[Any], limit: float, what: str) -> list[Any]:
        """ray.get of `refs`, giving up at a stop or after `limit` s."""
        deadline = time.monotonic() + limit
        while True:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0.2)
            if len(ready) == len(refs):
                return list(self.ray.get(refs))
            if self.stop_asked.is_set():
                raise _Stopped()
            if time.monotonic() > deadline:
                raise LaunchError(f"{what} did not happen within {limit:g} s")

    def _place(self) -> None:
        from ray.util.placement_group import placement_group

        n, k = self.request.num_nodes, self.per_node
        bundle = {"CPU": float(k), **({"GPU": float(k)} if self.request.use_gpu else {})}
        keys = tuple(bundle)
        asked = f"{n} node(s) with {_resources(bundle, keys)} each"
        totals = [n_.get("Resources", {}) for n_ in alive_nodes(self.ray)]
        fit = [t for t in totals if all(t.get(key, 0) >= v for key, v in bundle.items())]
        if len(fit) < n:
            raise LaunchError(
                f"the Ray cluster cannot hold this call: asked for {asked}, but only {len(fit)} of its "
                f"{len(totals)} node(s) have that much. {self._free_text(keys)}"
            )
        self.pg = placement_group([bundle] * n, strategy="STRICT_SPREAD", name=f"air_magic-{self.job[:12]}")
        deadline = time.monotonic() + PLACEMENT_WAIT
        ready = self.pg.ready()
        while not self.ray.wait([ready], timeout=0.2)[0]:
            if self.stop_asked.is_set():
                raise _Stopped()
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the Ray cluster could not reserve {asked} within {PLACEMENT_WAIT:g} s: other work holds "
                    f"them. {self._free_text(keys)}"
                )

    def _free_text(self, keys: tuple[str, ...]) -> str:
        try:
            from ray._private.state import available_resources_per_node
        except ImportError:
            return ""
        free = available_resources_per_node()
        nodes = {n_["NodeID"]: n_ for n_ in alive_nodes(self.ray)}
        parts = [
            f"{nodes[nid].get('NodeManagerAddress', '?')} ({nid[:8]}): {_resources(res, keys)}"
            for nid, res in free.items() if nid in nodes
        ]
        return "Free now: " + ("; ".join(parts) or "nothing") + "."

    def _start_ranks(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        req, k = self.request, self.per_node
        actor_cls = self.launcher.actor_class()
        for rank in range(req.world_size):
            self.actors.append(actor_cls.options(
                num_cpus=1, num_gpus=1 if req.use_gpu else 0, max_concurrency=4, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank // k),
            ).remote(_PKG_PARENT))
        self.infos = self._wait([a.where.remote() for a in self.actors], START_WAIT, "starting the ranks' Ray actors")
        master = self.infos[0]["ip"]
        port = self._wait([self.actors[0].free_port.remote(master)], START_WAIT, "finding a free port on rank 0's node")[0]
        base = _rank_env(req)
        loopback = all(i["ip"].startswith("127.") or i["ip"] == "::1" for i in self.infos)
        if loopback:  # nodes of one machine (a simulated cluster): keep gloo and NCCL on loopback as locally
            loopback_sockets(base)
        base.update(AIR_MAGIC_JOB=req.job_id)
        payload = self.ray.put(req.payload)  # through the object store, fetched by each node once
        job = p.JobFile.of(req)
        refs = []
        for rank, actor in enumerate(self.actors):
            node, local = divmod(rank, k)
            env = dict(base, AIR_MAGIC_RAY_NODE_ID=self.infos[rank]["node_id"])
            env.update(torchrun_env(
                rank=rank, world_size=req.world_size, local_rank=local, local_world_size=k, node_rank=node,
                master_addr=master, master_port=port, agent_store=False,
            ))
            if req.use_gpu:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(
                    gpu for i in self.infos[node * k:(node + 1) * k] for gpu in i["gpus"][:1]
                )
            refs.append(actor.start.remote(rank, payload, job, env))
        for rank, pid in enumerate(self._wait(refs, START_WAIT, "starting the ranks")):
            self.started.add(rank)
            self.events.put(p.RankStarted(self.job, rank, int(pid)))

    def _watch(self) -> None:
        ray = self.ray
        pending = {a.poll.remote(0, 0, POLL_WAIT): r for r, a in enumerate(self.actors)}
        while pending:
            if self.stop_asked.is_set():
                return  # the teardown ends the ranks; their exits are reported after it
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.1)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    data, metrics, outcome = ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    outcome = None
                except ray.exceptions.RayActorError as exc:
                    self._lost(rank, exc)
                    continue
                else:
                    self._metrics(rank, metrics)
                    self._output(rank, data)
                if outcome is None:
                    again = self.actors[rank].poll.remote(self.offsets[rank], self.metrics_offsets[rank], POLL_WAIT)
                    pending[again] = rank
                else:
                    self._exited(rank, outcome)

    def _output(self, rank: int, data: bytes) -> None:
        if not data:
            return
        self.offsets[rank] += len(data)
        with open(self.run_dir.log(rank), "ab") as f:
            f.write(data)
        text = self.decoders[rank].decode(data)
        if text:
            self.events.put(p.RankOutput(self.job, rank, text))

    def _metrics(self, rank: int, data: bytes) -> None:
        """Lines the rank's MLflow relay wrote (mlflow_relay.py), for the notebook's MLflow listener to log."""
        if data:
            self.metrics_offsets[rank] += len(data)
            fd = os.open(self.run_dir.metrics(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def _flush_decoder(self, rank: int) -> None:
        text = self.decoders[rank].decode(b"", final=True)
        if text:
            self.events.put(p.RankOutput(self.job, rank, text))

    def _exited(self, rank: int, outcome: dict[str, Any]) -> None:
        """Keep what the rank left in the run directory here, and report its exit."""
        rd = self.run_dir
        for key, path in (("result", rd.result(rank)), ("error", rd.error(rank)), ("error_pickle", rd.error_pickle(rank))):
            if outcome.get(key) is not None:
                write_private(path, outcome[key], exclusive=False)
        error = read_error_file(rd.error(rank), rd.error_pickle(rank), rank)
        result = p.RankOutcome(value=None if error is not None else outcome.get("result"), error=error,
                               error_at=outcome.get("error_at"))
        self._flush_decoder(rank)
        self.exited.add(rank)
        code = outcome.get("code")
        self.events.put(p.RankExited(self.job, rank, 70 if code is None else int(code), time.time(), result))

    def _lost(self, rank: int, exc: BaseException) -> None:
        """The rank's actor died under it: its process, or its whole node."""
        info = self.infos[rank] if rank < len(self.infos) else {}
        node_id = info.get("node_id", "")
        alive = {n["NodeID"] for n in alive_nodes(self.ray)}
        where = f"node {info.get('ip', '?')} ({node_id[:8]})"
        if node_id and node_id not in alive:
            why = f"its {where} left the Ray cluster"
        else:
            why = f"its Ray actor (pid {info.get('pid', '?')} on {where}) died"
        detail = " ".join(str(exc).split())[:400]
        error = WorkerDiedError(
            f"rank {rank} was lost: {why}, without a Python exception from the rank. Ray said: {detail}"
        )
        self._flush_decoder(rank)
        self.exited.add(rank)
        self.events.put(p.RankExited(self.job, rank, -signal.SIGKILL, time.time(), p.RankOutcome(error=error)))

    def _teardown(self) -> None:
        """End the ranks' child processes, kill every actor, remove the placement group, wait until they are gone."""
        ray = self.ray
        if self.actors and self.stop_asked.is_set():
            self._stacks_before_stopping()
        if self.actors:
            ends = [a.terminate.remote(self.grace) for a in self.actors]
            # dead actors answer with errors; every actor is killed below anyway
            with contextlib.suppress(Exception):
                ray.wait(ends, num_returns=len(ends), timeout=self.grace + 6)
            for actor in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            self._wait_dead(10.0)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)

    def _stacks_before_stopping(self) -> None:
        """Ranks still running write their stacks to their logs, which are read here once more (a second at most)."""
        from ..stacks import STOPPING

        running = sorted(self.started - self.exited)
        if not running:
            return
        with contextlib.suppress(Exception):
            asked = [self.actors[r].dump_stacks.remote(STOPPING) for r in running]
            self.ray.wait(asked, num_returns=len(asked), timeout=1.0)
            polls = {r: self.actors[r].poll.remote(self.offsets[r], self.metrics_offsets[r], 0) for r in running}
            self.ray.wait(list(polls.values()), num_returns=len(polls), timeout=1.0)
            for rank, ref in polls.items():
                with contextlib.suppress(Exception):
                    self._output(rank, self.ray.get(ref, timeout=0)[0])

    def _wait_dead(self, limit: float) -> None:
        try:
            from ray._private.state import actors as actor_table
        except ImportError:
            return
        deadline = time.monotonic() + limit
        ids = [a._actor_id.hex() for a in self.actors]
        while time.monotonic() < deadline:
            try:
                if all(actor_table(actor_id=i).get("State") == "DEAD" for i in ids):
                    return
            except Exception:  # noqa: BLE001 - a state API that changed: do not wait on it
                return
            time.sleep(0.1)


class RayLauncher(Launcher):
    """Ranks on the nodes of the Ray cluster this notebook joined with `ray_init`."""

    def __init__(self) -> None:
        self._jobs: set[RayJob] = set()
        self._lock = threading.Lock()
        self._actor_class: Any = None
        self._atexit = False

    def actor_class(self) -> Any:
        if self._actor_class is None:
            import ray
            from ray import cloudpickle

            from . import rank

            cloudpickle.register_pickle_by_value(rank)  # the nodes need not import this module (see rank.py)
            self._actor_class = ray.remote(RankActor)
        return self._actor_class

    def start(self, request: p.JobRequest, run_dir: RunDir) -> RayJob:
        ray = require_connected()
        with self._lock:
            if not self._atexit:  # registered after ray.init's own: runs before Ray disconnects at exit
                atexit.register(self.shutdown)
                self._atexit = True
            job = RayJob(self, request, run_dir, ray)
            self._jobs.add(job)
        return job

    def forget(self, job: RayJob) -> None:
        with self._lock:
            self._jobs.discard(job)

    def shutdown(self, timeout: float = 20.0) -> None:
        """Stop every job still running and wait for its teardown (at exit)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.stop("shutdown", 1.0)
        deadline = time.monotonic() + timeout
        for job in jobs:
            job.thread.join(max(0.0, deadline - time.monotonic()))


_launcher = RayLauncher()


def ray_launcher() -> RayLauncher:
    """This kernel's Ray launcher."""
    return _launcher
