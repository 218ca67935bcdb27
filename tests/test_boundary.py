"""The process boundary: listeners cannot change a call, the package has no import cycle, cells are logged as cells."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
from faults_common import Recorder
from helpers import ROOT, run_id_of

from air_magic import runner
from air_magic.errors import ListenerWarning
from air_magic.job import JobStatus, RankState
from air_magic.listeners import Listener

#: Runs started here keep their directories under pytest's temporary directory (see faults_common).
pytestmark = [pytest.mark.usefixtures("here_runs"), pytest.mark.slow]
HOOKS = ("on_start", "worker_env", "worker_hooks", "on_output", "on_rank_state", "poll", "on_end")


class Raises(Listener):
    """A listener whose every hook raises."""

    def __getattribute__(self, name: str):
        if name in HOOKS:

            def boom(*args, **kwargs):
                raise RuntimeError(f"{name} is broken")

            return boom
        return object.__getattribute__(self, name)


def _two_ranks() -> int:
    import os

    print("rank", os.environ["RANK"], "says hello", flush=True)
    return int(os.environ["RANK"]) * 10


def _fails() -> int:
    import os

    if os.environ["RANK"] == "1":
        raise KeyError("the real error")
    return 0


def test_a_listener_that_raises_in_every_hook_is_a_warning_and_changes_nothing():
    """Each failing hook is a ListenerWarning naming the listener and hook; results and the other listeners are
    intact."""
    rec = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = runner.run(_spec(_two_ranks), [Raises(), rec])
    assert result.status == JobStatus.FINISHED and result.error is None and result.values == [0, 10]
    failed = {str(w.message).split(" failed")[0] for w in caught if issubclass(w.category, ListenerWarning)}
    assert failed == {f"air_magic: Raises.{hook}" for hook in HOOKS}
    assert rec.result is result, "the listener after the broken one still heard on_end"
    assert rec.states[0][-1] == RankState.DONE and "says hello" in rec.output(1)


def test_a_failed_call_is_returned_not_raised_and_a_broken_listener_does_not_replace_its_error():
    """runner.run hands back a FAILED JobResult carrying the rank's own exception, whatever the listeners do."""
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        result = runner.run(_spec(_fails), [Raises(), Recorder()])
    assert result.status == JobStatus.FAILED and isinstance(result.error, KeyError)
    assert "raised on rank 1 of 2" in result.error.__notes__[0]
    with pytest.raises(KeyError, match="the real error"):
        result.raise_for_status()


def _spec(func):
    import cloudpickle

    from air_magic import distributed

    cloudpickle.register_pickle_by_value(__import__(__name__))
    return distributed(2, accelerator_type="CPU", mlflow=False)(func).settings.spec(func, (), {}, func.__name__)


def _imports(path: Path, package: str) -> set[str]:
    """Every air_magic module `path` imports, at module level or inside functions."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
        base = module
    else:
        base = module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package)}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                root = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{root}.{node.module}" if node.module else root
            else:
                target = node.module or ""
            if not target.startswith(package):
                continue
            for alias in node.names:  # `from . import runner` imports a module; `from .job import JobSpec` a name
                sub = f"{target}.{alias.name}"
                found.add(sub if _module_path(sub) is not None else target)
    return {m for m in found if _module_path(m) is not None and m != module}


def _module_path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def test_the_package_has_no_import_cycle():
    """No air_magic module imports, directly or through others, a module that imports it back (lazy imports
    included)."""
    graph = {}
    for path in (ROOT / "air_magic").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _imports(path, "air_magic")
    assert "air_magic.launch.local" in graph and "air_magic.runner" in graph["air_magic.decorator"]
    # The package's __init__ re-exports public names: importing a submodule runs it, which is not a design cycle.
    graph["air_magic"] = set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, set())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_cell_runs_are_logged_as_cells_and_functions_as_functions(kernel, workdir):
    """The MLflow run of a %%distributed cell records `cell`, that of a decorated function records `function`."""
    mlflow = pytest.importorskip("mlflow")
    kernel.execute("%load_ext air_magic").check()
    cell = kernel.execute("%%distributed --gpus 2\nimport os\nint(os.environ['RANK'])").check()
    func = kernel.execute(
        "from air_magic import distributed\n@distributed(2)\ndef ranks():\n    return 1\nranks.distributed()"
    ).check()
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    ids = [run_id_of(out.stdout) for out in (cell, func)]
    params = [client.get_run(i).data.params for i in ids]
    assert "cell" in params[0] and "function" not in params[0]
    assert params[1].get("function") == "ranks" and "cell" not in params[1]
