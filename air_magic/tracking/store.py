"""Where a call's run is stored, as the notebook sees it: the store's absolute URI, the artifact root of a
local sqlite store, the default experiment's name, and MLflow's log noise kept out of the cell.

Plain functions shared by the listener (listener.py) and the background set-up (prepare.py); nothing
here imports mlflow.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

#: The module every rank of a tracked call imports (see hook.py), and the one a warm helper warms up: named
#: here because ranks and the helper find it by name.
HOOK = "air_magic.tracking.hook"

#: Experiment used when neither mlflow.set_experiment nor MLFLOW_EXPERIMENT_NAME/ID chose one
#: and the notebook or script name is unknown.
FALLBACK_EXPERIMENT = "air_magic"

#: Artifacts of experiments air_magic creates over a local sqlite store go here, next to the database.
ARTIFACTS_DIR = "mlartifacts"
_QUIET_LOGGERS = ("mlflow", "alembic")


@contextmanager
def quiet_mlflow_logs() -> Iterator[None]:
    """Keep MLflow's (and alembic's) INFO lines out of the cell output; warnings and errors still show."""
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        if lg.getEffectiveLevel() < logging.WARNING:
            lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def sqlite_artifact_root(tracking_uri: str) -> str | None:
    """`<folder of the database>/mlartifacts` for a local sqlite store, else None (MLflow decides)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///") :]
    if not path.startswith("/"):
        return None
    return str(Path(path).parent / ARTIFACTS_DIR)


def absolute_uri(uri: str) -> str:
    """`uri` with a relative sqlite or file path made absolute, so workers and the UI open the same store."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        path = uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else ""
        if path and not path.startswith("/") and path != ":memory:":
            return "sqlite:///" + os.path.abspath(path)
        return uri
    if parsed.scheme in ("", "file") and not parsed.netloc:
        path = parsed.path if parsed.scheme == "file" else uri
        return Path(os.path.abspath(path)).as_uri()
    return uri


def default_experiment_name() -> str:
    """The notebook's file name under Jupyter, else the script's, else 'air_magic'."""
    session = os.environ.get("JPY_SESSION_NAME")
    if session:
        return os.path.basename(session.rstrip("/")) or FALLBACK_EXPERIMENT
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script and "ipykernel" not in script and not script.endswith("ipython"):
        return os.path.basename(script)
    return FALLBACK_EXPERIMENT
