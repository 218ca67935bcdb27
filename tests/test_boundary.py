"""The process boundary: listeners cannot change a call, cells are logged as cells (no import cycle: tests/unit)."""

from __future__ import annotations

import warnings

import pytest
from faults_common import Recorder
from helpers import run_id_of

from air_magic.errors import ListenerWarning
from air_magic.job import JobStatus, RankState
from air_magic.listeners import Listener
from air_magic.owner import owner

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
        result = owner().submit(_spec(_two_ranks), listeners=[Raises(), rec])
    assert result.status == JobStatus.FINISHED and result.error is None and result.values == [0, 10]
    failed = {str(w.message).split(" failed")[0] for w in caught if issubclass(w.category, ListenerWarning)}
    assert failed == {f"air_magic: Raises.{hook}" for hook in HOOKS}
    assert rec.result is result, "the listener after the broken one still heard on_end"
    assert rec.states[0][-1] == RankState.DONE and "says hello" in rec.output(1)


def test_a_failed_call_is_returned_not_raised_and_a_broken_listener_does_not_replace_its_error():
    """runner.run hands back a FAILED JobResult carrying the rank's own exception, whatever the listeners do."""
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        result = owner().submit(_spec(_fails), listeners=[Raises(), Recorder()])
    assert result.status == JobStatus.FAILED and isinstance(result.error, KeyError)
    assert "raised on rank 1 of 2" in result.error.__notes__[0]
    with pytest.raises(KeyError, match="the real error"):
        result.raise_for_status()


def _spec(func):
    import cloudpickle

    from air_magic import distributed

    cloudpickle.register_pickle_by_value(__import__(__name__))
    return distributed(2, accelerator_type="CPU", mlflow=False)(func).settings.spec(func, (), {}, func.__name__)


@pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
def test_cell_runs_are_logged_as_cells_and_functions_as_functions(kernel, workdir):
    """The MLflow run of a %%distributed cell records `cell`, that of a decorated function records `function`."""
    import mlflow

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
