"""Detached calls: a call owned by a process of its own, which outlives the kernel or command line that started it.

`start(spec)` (from `detach=True`, `%%distributed --detach` or `air-magic run`) checks the call pickles, makes
its run directory (whose name is the call's id), writes into it what to run (`detached.pkl`: the payload the
ranks would get, the job's settings, sys.path, working directory, MLflow experiment) and starts
`python -m air_magic.owner.detached RUN_DIR` in a new session with its output in `owner.log`, so the death of its
starter (a kernel's SIGKILL, a restart, a closed terminal) does not reach it. It returns the run directory
once the owner holds the call (its live record names it).

The owner process (`main`) is an owner like a kernel, with the same code (air_magic/owner/): its call goes through
that owner's one door, in its table with its id; it takes the call's GPUs or CPU slots in the machine-wide ledger
(waiting, and saying for what, in its record) and runs it with the default listeners (MLflow run, live record, text
display), and leaves the final record; the ranks' results are in the run directory for any process to read
(record.py, attached.py). A cancel asked from any process (the `cancel` file) or a SIGTERM cancels the
call; if the owner is killed, its helper and ranks go with it, as a kernel's do. Not for: reading or
showing a call from another process (attached.py).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import payload
from ..errors import AirMagicError
from ..job import JobSpec
from ..launch.files.rundir import RunDir, write_private
from . import record as call_record

#: The module `python -m` runs as a detached call's owner process.
OWNER_MODULE = "air_magic.owner.detached"
#: Seconds `start` waits for the owner process to take its call.
READY_WAIT = 120.0


def _gone(*args: Any, **kwargs: Any) -> None:  # what the pickled settings carry in place of the call
    raise AirMagicError("a detached call's settings were run without its call")


def start(
    spec: JobSpec,
    role: str = "detached",
    experiment_name: str | None = None,
    parent_run_id: str | None = None,
    experiment_id: str | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    prepare: Callable[[Path], None] | None = None,
) -> Path:
    """Start `spec` in an owner process of its own; its run directory (`.name` is the call's id) once it runs there.

    `role` names the owner to waiting calls ("detached" from a notebook, "cli" from the command line); `env`
    adds to this process's environment, which the owner (and so the ranks) inherit; `prepare(run_dir)` writes
    what the call reads into its run directory before the owner starts (if it raises, nothing is left).
    """
    blob = payload.serialize(spec.target, spec.args, spec.kwargs)  # fails here, before anything starts
    if spec.session is not None:
        raise AirMagicError("a call in a session cannot be detached: its ranks belong to this kernel's session.")
    run = RunDir.create(spec.name, spec.world_size)
    if prepare is not None:
        try:
            prepare(run.path)
        except BaseException:
            run.remove()
            raise
    settings = dataclasses.replace(spec, target=_gone, args=(), kwargs={})
    workdir = cwd or os.getcwd()
    hand_off: dict[str, Any] = {
        "blob": blob,
        "spec": settings,
        "sys_path": list(sys.path),
        "cwd": workdir,
        "role": role,
        "experiment_name": experiment_name,
        "parent_run_id": parent_run_id,
        "experiment_id": experiment_id,
    }
    write_private(run.detached_call, pickle.dumps(hand_off))
    fd = os.open(run.owner_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", OWNER_MODULE, str(run.path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # the starter's end (a kernel's SIGKILL, a closed terminal) never reaches it
        )
    deadline = time.monotonic() + READY_WAIT
    while time.monotonic() < deadline:
        record = call_record.read(run.path) or {}
        if (record.get("owner") or {}).get("pid") == proc.pid:
            return run.path
        if proc.poll() is not None:
            tail = run.owner_log.read_text(errors="replace")[-2000:]
            raise AirMagicError(f"the detached call's owner process ended at once (exit {proc.returncode}):\n{tail}")
        time.sleep(0.05)
    raise AirMagicError(f"the detached call's owner process did not start within {READY_WAIT:g} s; see {run.owner_log}")


def main(
    argv: list[str],
    submit_as: Callable[[str], Callable[..., Any]],
    listeners_for: Callable[[JobSpec, dict[str, Any]], list[Any]],
) -> int:
    """The owner process of one detached call: run it through its owner's one door (`submit_as(role)`: that
    process's `Owner.submit`, air_magic/owner/detached.py) with the listeners `listeners_for(spec, hand_off)`
    plugs in, record how it ended; 0 if it finished."""
    from ..launch.rank.carried import load_call

    path = Path(argv[0])
    run = RunDir(path)
    hand_off = pickle.loads(run.detached_call.read_bytes())
    submit = submit_as(hand_off["role"])
    record = call_record.CallRecord(path, hand_off["role"])
    record.begin(hand_off["spec"], call_record.WAITING, waiting_for="")  # its starter returns from here
    signal.signal(signal.SIGTERM, lambda *_: call_record.request_cancel(path))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        sys.path[:] = hand_off["sys_path"]
        os.chdir(hand_off["cwd"])
        target, args, kwargs, _ = load_call(hand_off["blob"])
        spec: JobSpec = dataclasses.replace(hand_off["spec"], target=target, args=args, kwargs=kwargs)
        if spec.num_nodes > 1:  # the cluster its starter had joined ($RAY_ADDRESS), else this machine's `ray start`
            from ..launch import ray_init

            ray_init(os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
    except BaseException as exc:  # noqa: BLE001 - the call could not be made here: that is how it ended
        traceback.print_exc()
        record.end(None, exc)
        return 1
    ended: dict[str, Any] = {"result": None, "error": None}

    def waiting(why: str) -> None:
        print(f"air_magic: {spec.name} waits for {why}", flush=True)
        record.waiting(why)

    def run_call() -> None:
        try:
            ended["result"] = submit(
                spec, listeners=listeners_for(spec, hand_off), run_dir=run, on_wait=waiting, record=record
            )
            ended["error"] = ended["result"].error
        except BaseException as exc:  # noqa: BLE001 - recorded as the call's end
            ended["error"] = exc

    # Not on the main thread: nobody is at this process's stdin, so a rank's breakpoint() waits for
    # `%distributed_debug` from a kernel, as a background call's does; the main thread keeps the signals.
    thread = threading.Thread(target=run_call, name=f"air_magic-detached-{path.name}")
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    record.end(ended["result"], ended["error"])  # nothing if its handle wrote the end (it always does once it ran)
    run.detached_call.unlink(missing_ok=True)
    return 0 if ended["error"] is None else 1
