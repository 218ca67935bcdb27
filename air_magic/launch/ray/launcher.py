"""The Ray launcher: the ranks of a call as Ray actors on several machines, behind the same Launcher interface.

For N nodes with k ranks each, a placement group of N bundles (k CPUs, and k
GPUs for GPU ranks) is asked for with STRICT_SPREAD, so each bundle is a
different machine and nothing starts until all of them are reserved. Rank r
is actor r % k of bundle r // k: ranks are ordered by node, then local rank.
The actors are asked for together with the placement group, and each
imports torch while it waits for the call. Rank 0's node gives MASTER_ADDR
and a free MASTER_PORT, so an unchanged `init_process_group()` meets there.
The pickled call travels through Ray's object store.

A thread per job (the pump) does every blocking Ray call: it places the job,
starts the ranks, long-polls each actor for output (written to the rank's log
in the run directory here, the full record, and reported as `RankOutput`)
and for its outcome, and tears everything down: the ranks' own child
processes, the actors, the placement group. A rank whose actor or node dies
is reported as a `WorkerDiedError`. The runner sees only the events.

Hot ranks (`keep_alive`): after a call in which every rank succeeded, its
actors, their placement group, what they imported and their default process
group stay as a `HotWorld`; the next call of the same world (`world_key`,
node count) runs in them, with the first call's MASTER_ADDR and MASTER_PORT.
A hot world ends when it has been idle `keep_alive` s, when a call in it
fails or is stopped (cancel, timeout, Ctrl-C), on `release_hot()` or
`shutdown()`, and when a call of another world waits for resources (idle
hot ranks may hold them). One whose node or actor was lost meanwhile is
ended and the call gets fresh ranks.
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
from dataclasses import dataclass, field
from typing import Any

from ...envvars import JOB, RAY_NODE_ID
from ...errors import WorkerDiedError
from .. import protocol as p
from ..boot import INTERNAL_ERROR, PACKAGE_PARENT, preload_modules
from ..env import loopback_sockets, torchrun_env
from ..errorfile import read_error_file
from ..interface import JobHandle, Launcher, drain
from ..rundir import RunDir, write_private
from .cluster import alive_nodes, require_connected
from .cluster import warming as cluster_warming
from .rank import RankActor

#: How long a placement the cluster could hold may wait for resources that are busy, in seconds.
PLACEMENT_WAIT = 45.0
#: How long the actors of a placed job may take to start, in seconds (a busy node takes long to start Ray workers).
START_WAIT = 300.0
#: Seconds an actor's poll waits for new output before it answers with none.
POLL_WAIT = 0.5
#: Variables of the notebook that describe its own machine, not the ranks' machines.
NODE_LOCAL_ENV = frozenset(
    {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_"}
)


class LaunchError(Exception):
    """The job cannot be placed or started; the message says why."""


class _Stopped(Exception):
    """A stop came while the job was being placed or started."""


@dataclass(eq=False)
class HotWorld:
    """Actors kept between calls of one world: their placement group, where they run, where their group meets."""

    key: str
    actors: list[Any]
    pg: Any
    places: list[p.ActorPlace]
    master: str
    port: int
    keep_alive: float
    #: A call runs in it now.
    busy: bool = True
    #: Ends it once it has been idle `keep_alive` s.
    timer: threading.Timer | None = field(default=None, repr=False)


def _world_key(request: p.JobRequest) -> str:
    return f"{request.world_key}/{request.num_nodes}x{request.world_size // request.num_nodes}/{request.use_gpu}"


def end_actors(ray: Any, actors: list[Any], pg: Any, grace: float) -> None:
    """End the ranks' child processes, kill every actor, remove the placement group, wait until they are gone."""
    if actors:
        ends = [a.terminate.remote(grace) for a in actors]
        # dead actors answer with errors; every actor is killed below anyway
        with contextlib.suppress(Exception):
            ray.wait(ends, num_returns=len(ends), timeout=grace + 6)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        _wait_dead(actors, 10.0)
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(pg)


def _wait_dead(actors: list[Any], limit: float) -> None:
    try:
        from ray._private.state import actors as actor_table
    except ImportError:
        return
    deadline = time.monotonic() + limit
    ids = [a._actor_id.hex() for a in actors]
    while time.monotonic() < deadline:
        try:
            if all(actor_table(actor_id=i).get("State") == "DEAD" for i in ids):
                return
        except Exception:  # noqa: BLE001 - a state API that changed: do not wait on it
            return
        time.sleep(0.05)


def _rank_env(request: p.JobRequest) -> dict[str, str]:
    return {
        k: v
        for k, v in request.env.items()
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
        self.infos: list[p.ActorPlace] = []
        self.pg: Any = None
        #: The hot world this call runs in (reused, or made by this call when it asks for keep_alive).
        self.world: HotWorld | None = None
        self.started: set[int] = set()
        self.exited: set[int] = set()
        self.codes: dict[int, int] = {}
        self.failed = False
        self.decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(request.world_size)]
        self.offsets = [0] * request.world_size
        self.metrics_offsets = [0] * request.world_size
        self.thread = threading.Thread(target=self._pump, name=f"air_magic-ray-{self.job[:8]}", daemon=True)
        self.thread.start()

    # -- the JobHandle side (the runner's thread) ---------------------------
    def next_events(self, timeout: float) -> list[p.Event]:
        return drain(self.events, timeout)

    def stop(self, reason: str, grace: float, interrupt_after: float | None = None) -> None:
        self.grace = grace  # no sessions here: `interrupt_after` is never asked of this launcher
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
            world = self.launcher.take_hot(self.request)
            if world is None or not self._run_hot(world):
                self._await_prestart()
                self._place()
                self._start_ranks()
            self._watch()
        except _Stopped:
            pass
        except LaunchError as exc:
            self._fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the runner, never raised in a thread
            self._fail(f"the Ray launcher failed: {type(exc).__name__}: {exc}")
        finally:
            try:
                self._keep_or_teardown()
            except Exception as exc:  # noqa: BLE001
                self._fail(f"tearing the job down failed: {type(exc).__name__}: {exc}")
            for rank in sorted(self.started - self.exited):
                self._flush_decoder(rank)
                self.events.put(p.RankExited(self.job, rank, -signal.SIGKILL, time.time()))
            self.events.put(p.JobGone(self.job))

    def _await_prestart(self) -> None:
        """`prestart_workers` still starting the nodes' workers: wait for it, rather than have the nodes start more."""
        warming = cluster_warming()
        deadline = time.monotonic() + START_WAIT
        while warming is not None and warming.is_alive() and time.monotonic() < deadline:
            if self.stop_asked.is_set():
                raise _Stopped()
            warming.join(0.05)

    def _fail(self, message: str) -> None:
        self.failed = True
        self.events.put(p.LaunchFailed(self.job, message))

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

    def _run_hot(self, world: HotWorld) -> bool:
        """Start the call in the hot world's actors; False (the world ended) if a node or actor of it was lost."""
        self.world, self.actors, self.pg, self.infos = world, world.actors, world.pg, world.places
        alive = {n["NodeID"] for n in alive_nodes(self.ray)}
        lost = [pl for pl in world.places if pl.node_id not in alive]
        why = f"node {lost[0].ip} ({lost[0].node_id[:8]}) left the Ray cluster" if lost else ""
        if not lost:
            try:
                self._start_calls(world.master, world.port)
                return True
            except self.ray.exceptions.RayActorError as exc:
                why = f"a Ray actor of theirs died ({' '.join(str(exc).split())[:200]})"
        self.events.put(
            p.RankOutput(
                self.job, 0, f"air_magic: the hot ranks of this world were lost: {why}; starting fresh ranks.\n"
            )
        )
        self._end_world()
        return False

    def _end_world(self) -> None:
        """End the actors and placement group this job holds, and the hot world they belong to."""
        actors, pg, world = self.actors, self.pg, self.world
        self.actors, self.pg, self.infos, self.world = [], None, [], None
        if world is not None:
            self.launcher.drop(world)
        end_actors(self.ray, actors, pg, self.grace)

    def _place(self) -> None:
        """Ask for the placement group and, at once, for the actors in it; wait until every actor is up."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

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
        actor_cls, preload = self.launcher.actor_class(), preload_modules()
        for rank in range(self.request.world_size):  # queued by Ray until the group is placed, then started together
            self.actors.append(
                actor_cls.options(
                    num_cpus=1,
                    num_gpus=1 if self.request.use_gpu else 0,
                    max_concurrency=4,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=rank // k
                    ),
                ).remote(PACKAGE_PARENT, preload)
            )
        deadline = time.monotonic() + PLACEMENT_WAIT
        ready = self.pg.ready()
        while not self.ray.wait([ready], timeout=0.2)[0]:
            if self.launcher.hot_worlds():
                self.launcher.release_hot()  # idle hot ranks may hold what this call needs: it comes first
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
            for nid, res in free.items()
            if nid in nodes
        ]
        return "Free now: " + ("; ".join(parts) or "nothing") + "."

    def _start_ranks(self) -> None:
        """The placed actors: where each runs (rank 0 picks MASTER_PORT), then the call in each."""
        wheres = [a.where.remote(rank == 0) for rank, a in enumerate(self.actors)]
        self.infos = self._wait(wheres, START_WAIT, "starting the ranks' Ray actors")
        master, port = self.infos[0].ip, self.infos[0].free_port
        if self.request.keep_alive:
            self.world = HotWorld(
                _world_key(self.request), self.actors, self.pg, self.infos, master, port, float(self.request.keep_alive)
            )
        self._start_calls(master, port)

    def _start_calls(self, master: str, port: int) -> None:
        req, k = self.request, self.per_node
        base = _rank_env(req)
        loopback = all(i.ip.startswith("127.") or i.ip == "::1" for i in self.infos)
        if loopback:  # nodes of one machine (a simulated cluster): keep gloo and NCCL on loopback as locally
            loopback_sockets(base)
        base[JOB] = req.job_id
        payload = self.ray.put(req.payload)  # through the object store, fetched by each node once
        job = p.JobFile.of(req)
        refs = []
        for rank, actor in enumerate(self.actors):
            node, local = divmod(rank, k)
            env = {**base, RAY_NODE_ID: self.infos[rank].node_id}
            env.update(
                torchrun_env(
                    rank=rank,
                    world_size=req.world_size,
                    local_rank=local,
                    local_world_size=k,
                    node_rank=node,
                    master_addr=master,
                    master_port=port,
                    run_id=self.run_dir.path.name,  # the call's: the same for each of its restarts
                    agent_store=False,
                    restart_count=req.restart_count,
                    max_restarts=req.max_restarts,
                )
            )
            if req.use_gpu:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(
                    gpu for i in self.infos[node * k : (node + 1) * k] for gpu in i.gpus[:1]
                )
            refs.append(actor.start.remote(p.RankCall(rank, job, env, hot=bool(req.keep_alive)), payload))
        for rank, pid in enumerate(self._wait(refs, START_WAIT, "starting the ranks")):
            self.started.add(rank)
            self.events.put(p.RankStarted(self.job, rank, int(pid)))

    def _watch(self) -> None:
        ray = self.ray
        pending = {a.poll.remote(0, 0, POLL_WAIT): r for r, a in enumerate(self.actors)}
        while pending:
            if self.stop_asked.is_set():
                return  # the teardown ends the ranks; their exits are reported after it
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.1)
            if ready:  # and whatever else is in already
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                rank = pending.pop(ref)
                report: p.RankReport | None = None
                try:
                    report = ray.get(ref)
                except ray.exceptions.ActorUnavailableError:
                    pass
                except ray.exceptions.RayActorError as exc:
                    self._lost(rank, exc)
                    continue
                if report is not None:
                    self._metrics(rank, report.metrics)
                    self._output(rank, report.output)
                if report is None or report.done is None:
                    again = self.actors[rank].poll.remote(self.offsets[rank], self.metrics_offsets[rank], POLL_WAIT)
                    pending[again] = rank
                else:
                    self._exited(rank, report.done)

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
        """Lines the rank's MLflow relay wrote (tracking/relay.py), for the notebook's MLflow listener to log."""
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

    def _exited(self, rank: int, files: p.RankFiles) -> None:
        """Keep what the rank left in the run directory here, and report its exit."""
        rd = self.run_dir
        for data, path in (
            (files.result, rd.result(rank)),
            (files.error, rd.error(rank)),
            (files.error_pickle, rd.error_pickle(rank)),
        ):
            if data is not None:
                write_private(path, data, exclusive=False)
        error = read_error_file(rd.error(rank), rd.error_pickle(rank), rank)
        result = p.RankOutcome(value=None if error is not None else files.result, error=error, error_at=files.error_at)
        self._flush_decoder(rank)
        self.exited.add(rank)
        code = self.codes[rank] = INTERNAL_ERROR if files.code is None else int(files.code)
        self.events.put(p.RankExited(self.job, rank, code, time.time(), result))

    def _lost(self, rank: int, exc: BaseException) -> None:
        """The rank's actor died under it: its process, or its whole node."""
        self.failed = True
        info = self.infos[rank] if rank < len(self.infos) else None
        node_id = info.node_id if info is not None else ""
        alive = {n["NodeID"] for n in alive_nodes(self.ray)}
        where = f"node {info.ip if info else '?'} ({node_id[:8]})"
        if node_id and node_id not in alive:
            why = f"its {where} left the Ray cluster"
        else:
            why = f"its Ray actor (pid {info.pid if info else '?'} on {where}) died"
        detail = " ".join(str(exc).split())[:400]
        error = WorkerDiedError(
            f"rank {rank} was lost: {why}, without a Python exception from the rank. Ray said: {detail}"
        )
        self._flush_decoder(rank)
        self.exited.add(rank)
        self.events.put(p.RankExited(self.job, rank, -signal.SIGKILL, time.time(), p.RankOutcome(error=error)))

    def _keep_or_teardown(self) -> None:
        """A hot world whose call every rank finished cleanly stays for the next call; anything else ends."""
        world = self.world
        clean = (
            world is not None
            and not self.failed
            and not self.stop_asked.is_set()
            and len(self.codes) == self.request.world_size
            and not any(self.codes.values())
        )
        if clean and world is not None:
            self.launcher.keep(world)
        else:
            if self.actors and self.stop_asked.is_set():
                self._stacks_before_stopping()
            self._end_world()

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
                    self._output(rank, self.ray.get(ref, timeout=0).output)


class RayLauncher(Launcher):
    """Ranks on the nodes of the Ray cluster this notebook joined with `ray_init`; hot ranks kept as `HotWorld`s."""

    supports = frozenset({"keep_alive"})

    def __init__(self) -> None:
        self._jobs: set[RayJob] = set()
        self._worlds: list[HotWorld] = []
        self._lock = threading.Lock()
        self._actor_class: Any = None
        self._atexit = False

    def actor_class(self) -> Any:
        """RankActor as a Ray actor class (made once: Ray ships it to the nodes at its first use)."""
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

    # -- hot worlds ----------------------------------------------------------
    def take_hot(self, request: p.JobRequest) -> HotWorld | None:
        """An idle hot world of this call's world, now busy; None if there is none."""
        if not request.keep_alive:
            return None
        key = _world_key(request)
        with self._lock:
            world = next((w for w in self._worlds if not w.busy and w.key == key), None)
            if world is not None:
                world.busy = True
                if world.timer is not None:
                    world.timer.cancel()
            return world

    def keep(self, world: HotWorld) -> None:
        """A call in `world` is over and every rank succeeded: it waits `keep_alive` s for the next call."""
        with self._lock:
            if world not in self._worlds:
                self._worlds.append(world)
            world.busy = False
            world.timer = threading.Timer(world.keep_alive, self._expire, args=(world,))
            world.timer.daemon = True
            world.timer.start()

    def _expire(self, world: HotWorld) -> None:
        """Idle `keep_alive` s (this runs in the world's timer thread): end it, unless a call took it meanwhile."""
        with self._lock:
            if world.busy or world not in self._worlds or world.timer is not threading.current_thread():
                return  # taken by a call meanwhile, or already ended
            self._worlds.remove(world)
        self._end([world])

    def drop(self, world: HotWorld) -> None:
        """`world` is ending (its call failed, was stopped, or lost a rank): no call may take it."""
        with self._lock:
            if world in self._worlds:
                self._worlds.remove(world)
            if world.timer is not None:
                world.timer.cancel()

    def _end(self, worlds: list[HotWorld]) -> None:
        if not worlds:
            return
        ray = require_connected()
        for world in worlds:
            if world.timer is not None:
                world.timer.cancel()
            end_actors(ray, world.actors, world.pg, 3.0)

    def hot_worlds(self) -> list[HotWorld]:
        """The hot worlds kept now, idle or running a call."""
        with self._lock:
            return list(self._worlds)

    def release_hot(self) -> None:
        """End every idle hot world now: its actors and their placement group (a running call's ranks end with it)."""
        with self._lock:
            idle = [w for w in self._worlds if not w.busy]
            for world in idle:
                self._worlds.remove(world)
        with contextlib.suppress(Exception):  # a notebook no longer connected holds nothing
            self._end(idle)

    def shutdown(self, timeout: float = 20.0) -> None:
        """Stop every job still running, wait for its teardown, and end every hot world (at exit, on unload)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.stop("shutdown", 1.0)
        deadline = time.monotonic() + timeout
        for job in jobs:
            job.thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            worlds, self._worlds = self._worlds, []
        with contextlib.suppress(Exception):
            self._end(worlds)


_launcher = RayLauncher()


def ray_launcher() -> RayLauncher:
    """This kernel's Ray launcher."""
    return _launcher
