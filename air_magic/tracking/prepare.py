"""In the notebook: MLflow's import and its store's first set-up, done in the background before the first call.

A first call with MLflow on (the default) would otherwise wait for MLflow's
import (about a second) and, on a fresh local store, for the creation of its
tables (seconds). `start()`, called when the extension loads, does both on a
daemon thread while the user types: it imports mlflow, builds the tracking
store of the URI MLflow would use now (MLflow caches it per URI, so the call's
client finds it built) and reads the default experiment once. It makes no run
and no experiment, starts no UI, sends nothing to a remote server, and imports
nothing that touches CUDA. It asks the launchers' warm helper to prepare the
ranks' MLflow (hook.py's `preload`) twice: at once, to import mlflow there while
this process does the same, and once the store is set up, to load that store's
code for that URI; so the first calls' ranks find mlflow and the store's code
loaded. Last, it runs a full garbage collection: MLflow's import leaves some
hundred thousand new objects, and the full collection they would bring about
otherwise falls in the first call (0.1-0.25 s of CPU); done here, the first
call finds none pending.

The call's listener (listener.py) waits for it with `wait()` before it makes
its run, so a call made before it finishes simply waits for it (never a second
set-up of the same store). Failures are kept quiet here: the call then does
the same work itself and reports what goes wrong.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_thread: threading.Thread | None = None
_imported = threading.Event()  # set once mlflow's import is over (done or failed)


def start(prepare_hooks: Callable[[list[str], dict[str, str]], None] | None = None) -> None:
    """Start the preparation in this process, once; returns at once. `prepare_hooks` asks the launchers this process
    uses to prepare hook modules (its owner's `Launchers.prepare_hooks`); without it, only this process prepares."""
    global _thread
    with _lock:
        if _thread is not None:
            return
        _thread = threading.Thread(target=_prepare, args=(prepare_hooks,), name="air_magic-mlflow-prepare", daemon=True)
        _thread.start()


def importing() -> bool:
    """Whether the preparation is importing mlflow right now (mlflow may be in sys.modules half-made)."""
    return _thread is not None and not _imported.is_set()


def running() -> bool:
    """Whether the preparation was started and is not over yet."""
    thread = _thread
    return thread is not None and thread.is_alive()


def wait() -> None:
    """Block until the preparation (if it was started) is over."""
    thread = _thread
    if thread is not None:
        thread.join()


def _prepare(prepare_hooks: Callable[[list[str], dict[str, str]], None] | None) -> None:
    from .store import HOOK

    prepare_hooks = prepare_hooks or _no_launcher

    try:
        prepare_hooks([HOOK], {})  # mlflow's import only: no store is opened before this process has set it up
    except Exception:  # noqa: BLE001, S110 - the helper then prepares with the call
        pass
    try:
        import mlflow  # first: importing it sets its loggers' levels, which quiet_mlflow_logs overrides
    except Exception:  # noqa: BLE001 - the call imports it again and reports why
        return
    finally:
        _imported.set()
    try:
        _set_up_store(mlflow, prepare_hooks)
    finally:
        # The collection the first call would run otherwise: what MLflow's import and the store's set-up left.
        gc.collect()


def _no_launcher(hooks: list[str], env: dict[str, str]) -> None:
    """No launcher to prepare hooks in (a preparation started without the process's owner)."""


def _set_up_store(mlflow: Any, prepare_hooks: Callable[[list[str], dict[str, str]], None]) -> None:
    """Build the tracking store MLflow would use now (a local one only), then have the helper load its code."""
    from .store import HOOK, absolute_uri, default_experiment_name, quiet_mlflow_logs

    try:
        with quiet_mlflow_logs():
            from mlflow import MlflowClient
            from mlflow.entities import Param  # noqa: F401 - what the call's run creation imports
            from mlflow.utils import mlflow_tags  # noqa: F401

            uri = absolute_uri(mlflow.get_tracking_uri())
            if uri.partition(":")[0] in ("sqlite", "file"):  # a server: no request is sent before a call asks
                client = MlflowClient(uri, absolute_uri(mlflow.get_registry_uri() or uri))
                client.get_experiment_by_name(default_experiment_name())  # builds the store (tables), compiles queries
    except Exception:  # noqa: BLE001 - an optimisation: the call sets the store up itself and reports errors
        return
    # Only now that the store exists: a helper opening a fresh sqlite store while this process creates its
    # tables would race it ("table alembic_version already exists").
    try:
        prepare_hooks([HOOK], {"MLFLOW_TRACKING_URI": uri})
    except Exception:  # noqa: BLE001 - the helper then warms up after the first call instead
        return
