"""The owner of a process's calls, as one object: its table of calls, its keeper of kept worlds, its ledger over
the machine-wide leases, its sessions and its launchers, and `submit`, the one door every call goes through.

A process that makes calls has one (`owner()`): a Jupyter kernel, an `air-magic` command-line process, or a
detached call's owner process. As jupyter_client's `MultiKernelManager` holds every kernel by id in one instance,
and Ray's CLI, SDK and REST all go through one `JobManager.submit_job`, the front doors (the decorator, the magics,
the command line, a detached call's process, a session's push, pull and reset) all come here, and `run` is the only
caller of the runner. What a kept world holds is counted here: the call that leaves a world kept hands its GPUs or
CPU slots to it (`Claim.keep_in`), and the keeper tells the owner the moment it lets a world go, so they are free
again at once, machine-wide. Not for: a call's policy (calls/runner.py), a world's rules (launch/keeper.py).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..calls import attached, runner
from ..calls import detached as detached_calls
from ..calls import record as call_record
from ..calls.handle import DistributedCall
from ..calls.ledger import Ledger, machine_ledger
from ..calls.record import CallRecord
from ..calls.sessions import Sessions, without_held
from ..calls.table import CallTable
from ..job import JobResult, JobSpec
from ..launch import Launchers
from ..launch.files.rundir import RunDir
from ..launch.keeper import Keeper, World
from ..listeners import Listener
from ..profiling.live import check, profile_running
from ..profiling.profile import Profile
from ..tracking import _compat, orphans, prepare
from .claims import Claim
from .listeners import captured, default_listeners

#: How a call is run: on the caller's thread, on a thread of this process, or in an owner process of its own.
FOREGROUND, BACKGROUND, DETACHED = "foreground", "background", "detached"
MODES = (FOREGROUND, BACKGROUND, DETACHED)
#: Seconds between two looks of a process keeping idle hot ranks for another process's ask.
ANSWER_EVERY = 0.5


class Owner:
    """Everything one process keeps of its calls, and the one way in (`submit`)."""

    def __init__(self, role: str = "kernel", ledger: Ledger | None = None) -> None:
        #: What kind of process this is, as lease files and records name it: "kernel", "cli" or "detached".
        self.role = role
        call_record.on_orphaned(orphans.fail_run)  # a dead owner's MLflow run, ended by the first to find it
        self.table = CallTable()
        self.keeper = Keeper(on_end=self._world_ended)
        self.launchers = Launchers(self.keeper)
        self.sessions = Sessions(self)
        self._ledger = ledger
        self._ledger_lock = threading.Lock()
        self._watching: threading.Thread | None = None

    # -- what it holds --------------------------------------------------------------------------------
    @property
    def ledger(self) -> Ledger:
        """This node's GPUs and CPU slots, leased machine-wide (made at first use)."""
        with self._ledger_lock:
            if self._ledger is None:
                self._ledger = machine_ledger(lambda: self.role)
            return self._ledger

    def _world_ended(self, world: World) -> None:
        """The keeper let `world` go (idle timer, release, loss, a failed call, the kernel's end): what it held is
        free again now, under the keeper's lock, with no later look."""
        if self._ledger is not None:
            self._ledger.give_back(world)

    def claim(self, spec: JobSpec, call_id: str, name: str | None = None) -> Claim:
        """Call `call_id`'s claim on this node's units (none for a call on several nodes)."""
        ledger = self.ledger if spec.num_nodes == 1 else None
        return Claim(ledger, spec, f"call {call_id}", f"call {call_id} ({name or spec.name})")

    def _watch_for_askers(self) -> None:
        """While this process keeps idle hot ranks on leased units, a thread ends them when a call of another
        process asks for what they hold (claims.py asks); a session's ranks are never ended so."""
        with self._ledger_lock:
            if self._watching is not None and self._watching.is_alive():
                return
            self._watching = threading.Thread(target=self._answer_askers, name="air_magic-yield", daemon=True)
            self._watching.start()

    def _answer_askers(self) -> None:
        def plain(world: World) -> bool:
            return world.session is None and not world.spare

        ledger = self._ledger
        while ledger is not None and ledger.leases is not None and any(map(plain, self.keeper.worlds())):
            asker = ledger.leases.yield_asked()
            if asker is not None:
                why = f"{asker} needs the GPUs or CPU slots they held"
                self.keeper.release_if_idle(plain, why)
            time.sleep(ANSWER_EVERY)

    # -- the one door ---------------------------------------------------------------------------------
    def submit(
        self,
        spec: JobSpec,
        mode: str = FOREGROUND,
        *,
        listeners: list[Listener] | None = None,
        wait: bool = True,
        run_dir: RunDir | None = None,
        on_wait: Callable[[str], None] | None = None,
        record: CallRecord | None = None,
        recorded: bool = True,
        **detached: Any,
    ) -> Any:
        """Make a call of `spec`, in this process's table.

        - FOREGROUND: run it on this thread; its `JobResult` (a failed call's error is in `.error`).
        - BACKGROUND: start it on a thread; its `DistributedCall` at once (`wait=False`: refuse to queue).
        - DETACHED: start it in an owner process of its own (calls/detached.py); its run directory.

        `record`: the writer of the call's `call.json`, begun already (a detached call's process begins it before its
        call is loaded); `recorded=False`: the call leaves no record (a session's push, pull and reset).
        """
        if mode == FOREGROUND:
            listeners = default_listeners(spec) if listeners is None else listeners
            call = DistributedCall(spec, listeners, owner=self, record=record, recorded=recorded)
            return call.run_here(run_dir=run_dir, on_wait=on_wait)
        if mode == BACKGROUND:  # MLflow's active run is per thread: the spawning thread's, read now
            listeners = captured(default_listeners(spec)) if listeners is None else listeners
            return DistributedCall(spec, listeners, owner=self, record=record, recorded=recorded).start(wait=wait)
        if mode == DETACHED:
            path: Path = detached_calls.start(spec, **(detached or self._starter_tracking(spec)))
            return path
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")

    def run(
        self,
        call: DistributedCall,
        claim: Claim | None = None,
        run_dir: RunDir | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> JobResult:
        """Run `call` through the runner (the only caller), holding its GPUs or CPU slots (waiting for them first if
        another call holds them); a session's call is checked first and what it left recorded. The units of a world
        the call leaves kept stay held by that world."""
        spec = call.spec
        found = None
        if spec.session is not None:
            found = self.sessions.before(spec)
            self.table.check_free(spec.session, call)
        made_here = run_dir is None
        run_dir = run_dir or RunDir.create(spec.name, spec.world_size)
        call.named(run_dir.path)
        claim = claim or self.claim(spec, run_dir.path.name)
        say = on_wait or (lambda why: print(f"air_magic: {spec.name} waits for {why}", file=sys.stdout))
        asked = run_dir.path

        def cancelled() -> bool:  # a Cancel here, or from another process (its cancel file)
            return call.cancel_asked or call_record.cancel_requested(asked)

        try:
            with claim.held(spec, on_wait=say, cancelled=cancelled) as held:
                if held.session is not None:
                    held = dataclasses.replace(
                        held, target=without_held(held.target, self.sessions.held_names(held.session))
                    )
                launcher = self.launchers.used(self.launchers.for_nodes(held.num_nodes))
                result = runner.run(held, call.listeners, launcher, run_dir=run_dir)
                if self.keeper.left_by(run_dir.path.name, claim.keep_in) and held.session is None:
                    self._watch_for_askers()
                if held.session is not None:
                    self.sessions.after(held, result, found)
                return result
        except BaseException:
            # refused or interrupted before it started (a value that cannot be pickled, Ctrl-C while it waited)
            if made_here and call.ctx is None:
                run_dir.remove()
            raise

    def detach(self, spec: JobSpec) -> DistributedCall:
        """`detach=True`, `%%distributed --detach`: `spec` started in an owner process of its own (DETACHED), with
        this process's MLflow store and experiment; its handle, in this table, its panel drawn here in a notebook."""
        path = self.submit(spec, DETACHED)
        return attached.shown(attached.AttachedCall(path, self))

    def _starter_tracking(self, spec: JobSpec) -> dict[str, Any]:
        """What a detached call takes from this process: its MLflow store and active experiment, and the Ray
        cluster it joined (the owner process joins it too)."""
        env: dict[str, str] = {}
        experiment_id = None
        if spec.mlflow:
            prepare.wait()  # mlflow may be half imported by the extension's preparation (then in sys.modules)
        if "mlflow" in sys.modules and spec.mlflow:
            env["MLFLOW_TRACKING_URI"] = str(sys.modules["mlflow"].get_tracking_uri())
            experiment_id = _compat.active_experiment_id()
        ray = sys.modules.get("ray")
        if spec.num_nodes > 1 and ray is not None and ray.is_initialized():
            env["RAY_ADDRESS"] = str(ray.get_runtime_context().gcs_address)
        return {"experiment_id": experiment_id, "env": env}

    # -- what the notebook shows of a call ------------------------------------------------------------
    def show(self, call: DistributedCall) -> None:
        """Draw `call` here (display/follow.py): live while it runs, its record once ended."""
        from ..display.follow import show

        show(call)

    @staticmethod
    def profile(call: DistributedCall, steps: int, timeout: float | None) -> Profile:
        """Profile the next `steps` steps of every rank of the running `call` (profiling/live.py)."""
        check(steps, call.spec.watch)
        return profile_running(call.run_dir, call.world_size, steps, timeout, lambda: not call.done())

    @staticmethod
    def link_of(record: dict[str, Any]) -> str | None:
        """The link to the MLflow run of a call of any process, through this process's UI over its store."""
        from ..tracking.ui import call_link

        return call_link(record)

    # -- the end of the process ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every launcher used and whatever it still runs; every kept world ends, its units with it."""
        self.launchers.shutdown()


_owner: Owner | None = None
_owner_lock = threading.Lock()


def owner(role: str | None = None) -> Owner:
    """The one owner of this process (made at first use; `role` names the kind of process then)."""
    global _owner
    with _owner_lock:
        if _owner is None:
            _owner = Owner(role or "kernel")
        elif role is not None and role != _owner.role:
            _owner.role = role
        return _owner
