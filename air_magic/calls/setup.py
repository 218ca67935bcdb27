"""What a call is put together from before it starts: its settings checked against its launcher, the key of the
world it runs in, and the request its launcher gets. Its listeners are plugged in by the owner (owner/listeners.py).
Not for following a call once it started (the runner, runner.py) nor for judging what it left (outcome.py).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from .. import envvars
from ..errors import ConfigurationError
from ..job import JobSpec
from ..launch import protocol as p
from ..launch.env import cpu_launch_env, joined_init_env
from ..launch.files import flight_recorder
from ..launch.files.rundir import RunDir
from ..launch.interface import Launcher
from ..listeners import Listener


def job_request(
    spec: JobSpec,
    blob: bytes,
    run_dir: RunDir,
    launcher: Launcher,
    listeners: list[Listener],
    guarded: Callable[..., Any],
) -> p.JobRequest:
    """What the launcher gets for a call: its payload and the ranks' environment, with what each listener adds
    (`guarded` calls a listener's hook, a failure being a warning), sys.path and the working directory."""
    env = dict(os.environ)
    hooks: list[str] = []
    for listener in listeners:
        env.update(guarded(listener, "worker_env") or {})
        hooks += [h for h in guarded(listener, "worker_hooks") or () if h not in hooks]
    env.update(spec.extra_env)
    if spec.uses_gpu:
        # NCCL's flight recorder, dumped on its watchdog's timeout and when stacks are taken (the pipes are made
        # on the ranks' machine: only where the run directory is that machine's)
        env.update(flight_recorder.recorder_env(run_dir.path, env, pipes=spec.num_nodes == 1))
    env["PYTHONUNBUFFERED"] = "1"
    joined_init_env(env)  # no rank ends while a peer still connects to it
    env[envvars.INTERNAL_RUN_DIR] = str(run_dir.path)
    if "debug" in launcher.supports:
        env[envvars.DEBUG_SERVED] = "1"
    if not spec.uses_gpu and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.ranks_per_node))
    if not spec.uses_gpu:
        cpu_launch_env(env)  # a plain accelerate.Accelerator() joins the world, as under `accelerate launch --cpu`
    if not spec.uses_gpu and "CUDA_VISIBLE_DEVICES" not in spec.extra_env:
        # CPU workers on a GPU node see no GPU: `"nccl" if torch.cuda.is_available() else "gloo"` picks gloo
        env["CUDA_VISIBLE_DEVICES"] = ""
    return p.JobRequest(
        job_id=uuid.uuid4().hex,
        name=spec.name,
        world_size=spec.world_size,
        payload=blob,
        env=env,
        sys_path=list(sys.path),
        cwd=os.getcwd(),
        hooks=tuple(hooks),
        warm=spec.warm,
        keep_alive=spec.keep_alive,
        world_key=world_key(spec),
        num_nodes=spec.num_nodes,
        use_gpu=spec.uses_gpu,
        max_restarts=spec.max_restarts,
        session=spec.session,
        ranks=spec.ranks,
    )


def world_key(spec: JobSpec) -> str:
    """What two calls must share to run in the same hot ranks: world, accelerator, environment, sys.path.

    Variables whose names start with "_" are left out: libraries keep private per-process state there
    (MLflow's import adds a telemetry session id), which says nothing about the ranks' world.
    """
    import hashlib
    import json

    env = {k: v for k, v in {**os.environ, **spec.extra_env}.items() if not k.startswith("_")}
    world = {
        "size": spec.world_size,
        "type": spec.accelerator_type,
        "python": sys.executable,
        "env": sorted(env.items()),
        "sys_path": sys.path,
    }
    return hashlib.sha256(json.dumps(world).encode()).hexdigest()


def check_supported(spec: JobSpec, launcher: Launcher) -> None:
    """Refuse, before anything starts, a setting of the call that its launcher cannot honour."""
    if spec.keep_alive and "keep_alive" not in launcher.supports:
        raise ConfigurationError(
            f"keep_alive={spec.keep_alive:g} asks for hot ranks, which {type(launcher).__name__} cannot keep "
            "between calls; leave keep_alive unset (or --keep-alive out of %%distributed) for this call."
        )
    if spec.session is not None and "session" not in launcher.supports:
        raise ConfigurationError(
            f"session={spec.session!r} asks for state kept on the ranks between calls, which "
            f"{type(launcher).__name__} cannot keep yet; run this call without a session."
        )
    if spec.warm and "warm" not in launcher.supports:
        raise ConfigurationError(
            f"warm=True asks for ranks forked from a warm helper, which {type(launcher).__name__} does not start; "
            "leave warm unset for this call."
        )
