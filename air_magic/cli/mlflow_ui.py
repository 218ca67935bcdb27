"""The command line's MLflow links, and `air-magic ui [ID]`: a link that is printed opens a UI that is really there.

A call whose store is a configured server has that server's link. With a local store (sqlite, files) the UI of
the call's owner ends with the owner, so a command that follows a call (`run --watch`, `attach`, `logs
--follow`, `get --watch`) serves its own UI over the call's store while it runs (tracking/ui.py: started at the
first click, on 127.0.0.1) and prints its link; a command that returns at once (`get`) prints the link only
while one works after it returns, else the `air-magic ui ID` that serves it. `air-magic ui [ID]` serves the UI
of this machine's local store (the call's, or the environment's MLflow store) in the foreground, on 127.0.0.1,
until Ctrl-C. Not for: a kernel's links (tracking/ui.py, calls/attached.py).
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any
from urllib.parse import urlparse

from ..calls import record as call_record
from ..errors import AirMagicError


def on_server(record: dict[str, Any]) -> bool:
    """The call's MLflow run is on a configured server (its link needs no UI of ours)."""
    return urlparse(str(record.get("tracking_uri") or "")).scheme in ("http", "https")


def follow_link(record: dict[str, Any]) -> str | None:
    """The link to the call's run from a command that lives on (it serves a local store's UI while it does)."""
    from ..tracking.ui import call_link

    return call_link(record) if record.get("run_id") else None


def lasting_link(record: dict[str, Any]) -> str | None:
    """A link to the call's run that still works after this command returns: the server's, or the live owner's
    own local UI (an address on this machine); None when only `air-magic ui ID` would serve one."""
    if not record.get("run_id"):
        return None
    if on_server(record):
        return follow_link(record)
    link = str(record.get("link") or "")
    live = record.get("status") in call_record.LIVE
    return link if live and link.startswith("http://127.0.0.1:") else None


def get_line(record: dict[str, Any]) -> str:
    """`get`'s line for the call's MLflow run."""
    if not record.get("run_id"):
        return "mlflow: - (no MLflow run)"
    link = lasting_link(record)
    if link:
        return f"mlflow: {record['run_id']} {link}"
    return f"mlflow: {record['run_id']} (open it: air-magic ui {record['id']})"


def cmd_ui(args: argparse.Namespace) -> int:
    """Serve the MLflow UI of this machine's local store until Ctrl-C, with the link to call ID's run."""
    from ..tracking import ui
    from .reading import UsageError, find

    fragment = ""
    if args.id:
        record = call_record.load(find(args.id)) or {}
        if not record.get("run_id") or not record.get("tracking_uri"):
            raise UsageError(f"call {record.get('id', args.id)} has no MLflow run (it ran with mlflow=False)")
        store = str(record["tracking_uri"])
        fragment = f"#/experiments/{record['experiment_id']}/runs/{record['run_id']}?{ui.TRAINING_VIEW}"
    else:
        import mlflow

        from ..tracking.store import absolute_uri

        store = absolute_uri(mlflow.get_tracking_uri())
    if urlparse(store).scheme in ("http", "https"):
        print(f"air-magic: the MLflow store is the server {store}: " + (store.rstrip("/") + "/" + fragment))
        return 0
    if urlparse(store).scheme not in ("sqlite", "file", ""):
        raise UsageError(f"the MLflow store {store} is not a local one; open it with its own UI")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    served = ui.local_ui(store, None)
    print(f"air-magic: the MLflow UI of {store} at {served.direct_url} (Ctrl-C to stop)", flush=True)
    if fragment:
        print(f"air-magic: MLflow run: {served.direct_url}{fragment}", flush=True)
    try:
        ui.wait_ready(served)
        print("air-magic: the MLflow UI is ready", flush=True)
        while served.alive:
            time.sleep(0.5)
    except KeyboardInterrupt:
        served.stop()
        return 0
    except (RuntimeError, TimeoutError) as exc:
        served.stop()
        raise AirMagicError(str(exc)) from None
    raise AirMagicError(f"the MLflow UI ended; its log: {served.log_path}")
