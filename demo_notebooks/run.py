"""Run a demo notebook headless on this machine, then say where everything it made is.

    python demo_notebooks/run.py demo_notebooks/quickstart.ipynb

The notebook runs top to bottom in a real Jupyter kernel (nbclient), started in
the notebook's own directory as Jupyter would start it. Afterwards this script
prints where the executed copy is, the run directories air_magic made (each
rank's log and result), and the MLflow runs the notebook created, with the
command that opens them in the MLflow UI. It exits non-zero if a cell failed.

It is a convenience for trying the demos and for the tests; it is not part of
the air_magic package and adds nothing to how a call runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
_LINK = re.compile(r"MLflow run: (\S+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """Text without the colour codes IPython puts in tracebacks."""
    return _ANSI.sub("", text)


@dataclass
class DemoRun:
    """What one headless execution of a notebook produced."""

    notebook: nbformat.NotebookNode
    executed_copy: Path
    workdir: Path
    started: float
    elapsed: float
    error: str | None = None
    run_dirs: list[Path] = field(default_factory=list)
    mlflow_links: list[str] = field(default_factory=list)


def kernel_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The kernel's environment: this one, with air_magic importable even when it is not installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("AIR_MAGIC_DISPLAY", "text")  # a saved notebook cannot show a live panel: keep plain lines
    env.update(extra or {})
    return env


def stream_text(nb: nbformat.NotebookNode) -> str:
    """Everything the notebook's cells printed (stdout and stderr), in order."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
    return "".join(parts)


def cell_text(cell: nbformat.NotebookNode) -> str:
    """The text a code cell showed: printed lines and its result's text/plain."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def runs_root(env: dict[str, str]) -> Path:
    """Where air_magic puts run directories for a kernel with this environment (see air_magic.launch.files.rundir.runs_root)."""
    if env.get("AIR_MAGIC_RUNS_DIR"):
        return Path(env["AIR_MAGIC_RUNS_DIR"])
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "air_magic" / "runs"


def find_run_dirs(root: Path, workdir: Path, since: float) -> list[Path]:
    """Run directories made after `since` by calls whose working directory was `workdir`."""
    found = []
    if not root.is_dir():
        return found
    for path in root.iterdir():
        job = path / "job.json"
        try:
            if path.stat().st_mtime < since - 1:
                continue
            if Path(json.loads(job.read_text())["cwd"]).resolve() == workdir.resolve():
                found.append(path)
        except (OSError, ValueError, KeyError):
            continue
    return sorted(found)


@contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def mlflow_runs(workdir: Path, env: dict[str, str], since: float) -> tuple[str, list[dict]]:
    """(tracking URI, runs started after `since`) in the store the notebook used, seen from its directory."""
    import mlflow

    uri = env.get("MLFLOW_TRACKING_URI") or None
    with _cwd(workdir):
        client = mlflow.MlflowClient(tracking_uri=uri)
        resolved = mlflow.get_tracking_uri() if uri is None else uri
        if resolved.startswith("sqlite:///") and not resolved.startswith("sqlite:////"):
            resolved = "sqlite:///" + str(workdir.resolve() / resolved[len("sqlite:///"):])
        if resolved.startswith("sqlite:///") and not Path(resolved[len("sqlite:///"):]).exists():
            return resolved, []  # the notebook logged nothing there: do not create an empty store
        runs = []
        for exp in client.search_experiments():
            for run in client.search_runs(
                [exp.experiment_id], filter_string=f"attributes.start_time >= {int((since - 1) * 1000)}"
            ):
                runs.append(
                    {
                        "run_id": run.info.run_id,
                        "experiment_id": exp.experiment_id,
                        "experiment": exp.name,
                        "status": run.info.status,
                        "metrics": dict(run.data.metrics),
                    }
                )
    return resolved, runs


def execute(
    path: Path,
    workdir: Path | None = None,
    output: Path | None = None,
    timeout: float = 1800,
    env: dict[str, str] | None = None,
    append: list[str] | None = None,
) -> DemoRun:
    """Execute `path` headless in a fresh kernel started in `workdir`; save and return the executed copy.

    `append` adds code cells at the end (the tests use it to read the notebook's variables).
    A failing cell does not raise: the returned DemoRun has `error` set.
    """
    path = path.resolve()
    workdir = (workdir or path.parent).resolve()
    output = output or path.parent / "executed" / path.name
    nb = nbformat.read(path, as_version=4)
    for i, code in enumerate(append or []):
        cell = nbformat.v4.new_code_cell(code)
        cell["id"] = f"appended-{i}"
        nb.cells.append(cell)
    full_env = kernel_env(env)
    client = NotebookClient(
        nb, timeout=int(timeout), kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    started = time.time()
    error = None
    try:
        client.execute(env=full_env, cwd=str(workdir))
    except CellExecutionError as exc:
        error = strip_ansi(str(exc))
    elapsed = time.time() - started
    output.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, output)
    return DemoRun(
        notebook=nb,
        executed_copy=output,
        workdir=workdir,
        started=started,
        elapsed=elapsed,
        error=error,
        run_dirs=find_run_dirs(runs_root(full_env), workdir, started),
        mlflow_links=_LINK.findall(stream_text(nb)),
    )


def report(run: DemoRun, env: dict[str, str]) -> str:
    """The lines printed after a run: outcome, executed copy, results, MLflow."""
    lines = [
        f"{'FAILED' if run.error else 'ran'} {run.executed_copy.name} in {run.elapsed:.1f} s "
        f"(kernel working directory: {run.workdir})",
        f"executed copy: {run.executed_copy}",
    ]
    if run.error:
        lines.append(f"error:\n{run.error}")
    last = next((c for c in reversed(run.notebook.cells) if c.cell_type == "code" and c.get("outputs")), None)
    if last is not None and not run.error:
        lines.append("last cell's output:\n  " + cell_text(last).strip().replace("\n", "\n  "))
    for path in run.run_dirs:
        logs = sorted(p.name for p in path.glob("rank-*.log"))
        lines.append(f"results and per-rank logs: {path} ({', '.join(logs)})")
    for link in dict.fromkeys(run.mlflow_links):
        lines.append(f"MLflow run: {link}")
    try:
        uri, runs = mlflow_runs(run.workdir, env, run.started)
    except ImportError:
        uri, runs = "", []
    for r in runs:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(r["metrics"].items())) or "no metrics"
        lines.append(
            f"MLflow run {r['run_id']} in experiment {r['experiment']!r} ({r['status']}; last {metrics}); "
            f"store {uri}"
        )
    if runs:
        first = runs[0]
        lines.append(
            f"open it: mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000, then "
            f"http://127.0.0.1:5000/#/experiments/{first['experiment_id']}/runs/{first['run_id']}"
        )
    elif not run.mlflow_links:
        lines.append("MLflow: this notebook made no run")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--workdir", type=Path, help="the kernel's working directory (default: the notebook's)")
    parser.add_argument("--output", type=Path, help="where to save the executed copy (default: <dir>/executed/)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a cell may run (default 1800)")
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        parser.error(f"no notebook at {args.notebook}; the demos are in {ROOT / 'demo_notebooks'}")
    env = kernel_env()
    run = execute(args.notebook, args.workdir, args.output, args.timeout)
    print(report(run, env))
    return 1 if run.error else 0


if __name__ == "__main__":
    sys.exit(main())
