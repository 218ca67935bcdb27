"""What launchers declare and decide: supported settings, the local launcher's warm choice, the registry, the phase
text."""

from __future__ import annotations

from pathlib import Path

import pytest

from air_magic import launch
from air_magic.calls.runner import check_supported
from air_magic.display.starting import waiting_for
from air_magic.errors import ConfigurationError
from air_magic.job import JobSpec
from air_magic.launch import protocol as p
from air_magic.launch.files.rundir import RunDir
from air_magic.launch.interface import JobHandle, Launcher
from air_magic.launch.keeper import Keeper
from air_magic.launch.local import LocalLauncher


class Plain(Launcher):
    """A launcher that supports nothing beyond the basics."""

    def __init__(self) -> None:
        self.released = self.shut = 0
        self.warmed: list[tuple[list[str], dict[str, str]]] = []

    def start(self, request: p.JobRequest, run_dir: RunDir) -> JobHandle:
        raise NotImplementedError

    def release_hot(self) -> None:
        self.released += 1

    def shutdown(self) -> None:
        self.shut += 1

    def prepare_hooks(self, hooks: list[str], env: dict[str, str]) -> None:
        self.warmed.append((hooks, env))


def _spec(**kw) -> JobSpec:
    return JobSpec(target=print, args=(), kwargs={}, name="f", world_size=2, accelerator_type="CPU", timeout=None, **kw)


def _request(**kw) -> p.JobRequest:
    return p.JobRequest(job_id="j", name="f", world_size=2, payload=b"", env={}, sys_path=[], cwd="/", **kw)


@pytest.mark.parametrize("setting", [{"warm": True}, {"keep_alive": 60.0}])
def test_a_setting_the_launcher_cannot_honour_is_refused(setting):
    """warm=True or keep_alive on a launcher that lacks them is a ConfigurationError naming the setting and launcher."""
    with pytest.raises(ConfigurationError, match=f"{next(iter(setting))}.*Plain"):
        check_supported(_spec(**setting), Plain())


def test_the_local_launcher_honours_warm_and_keep_alive():
    """Both settings, and warm=False or unset anywhere, pass the check."""
    check_supported(_spec(warm=True, keep_alive=60.0), LocalLauncher(Keeper()))
    check_supported(_spec(warm=False), Plain())
    check_supported(_spec(), Plain())


def test_the_local_launcher_decides_warm(monkeypatch):
    """Unset warm follows AIR_MAGIC_WARM; an explicit one wins; hot ranks are always forked; hooks are passed on."""
    run_dir = RunDir(Path("/nonexistent"))
    launcher = LocalLauncher(Keeper())
    monkeypatch.setenv("AIR_MAGIC_WARM", "0")
    assert launcher.launch_message(_request(), run_dir).fork is False
    assert launcher.launch_message(_request(warm=True), run_dir).fork is True
    assert launcher.launch_message(_request(keep_alive=5.0, warm=False), run_dir).fork is True
    monkeypatch.setenv("AIR_MAGIC_WARM", "1")
    assert launcher.launch_message(_request(), run_dir).fork is True
    assert launcher.launch_message(_request(warm=False), run_dir).fork is False
    assert launcher.launch_message(_request(hooks=("a.hook",)), run_dir).hooks == ["a.hook"]


def test_release_and_shutdown_reach_every_used_launcher():
    """The launchers of a process note each launcher once and pass release and shutdown to each; the base class
    does nothing."""
    launchers = launch.Launchers(Keeper())
    first, second = Plain(), Plain()
    assert launchers.used(first) is first
    launchers.used(second)
    launchers.used(first)
    assert launchers.all_used() == [first, second]
    launchers.release_hot()
    launchers.shutdown()
    assert (first.released, first.shut, second.released, second.shut) == (1, 1, 1, 1)
    Launcher.release_hot(first)
    Launcher.shutdown(first)


def test_a_warm_up_request_reaches_every_used_launcher():
    """prepare_hooks passes the hooks and their environment to each launcher the process has used."""
    launchers = launch.Launchers(Keeper())
    first, second = launchers.used(Plain()), launchers.used(Plain())
    launchers.prepare_hooks(["air_magic.tracking.hook"], {"MLFLOW_TRACKING_URI": "sqlite:////x/mlflow.db"})
    assert (
        first.warmed
        == second.warmed
        == [(["air_magic.tracking.hook"], {"MLFLOW_TRACKING_URI": "sqlite:////x/mlflow.db"})]
    )
    Launcher.prepare_hooks(first, ["h"], {})


def test_the_launchers_of_a_process_share_its_keeper_and_are_made_once():
    """Both launchers a process makes are handed its one keeper, and each is made once."""
    keeper = Keeper()
    launchers = launch.Launchers(keeper)
    assert launchers.local is launchers.local and launchers.local.keeper is keeper
    assert launchers.for_nodes(1) is launchers.local


def test_the_local_launcher_starts_no_helper_to_warm_it_up():
    """Without a running helper, a warm-up request is dropped: it never starts one."""
    launcher = LocalLauncher(Keeper())
    launcher.prepare_hooks(["air_magic.tracking.hook"], {})
    assert launcher.supervisor_pid is None


def test_the_phase_text_follows_the_runners_phases():
    """What a starting call waits for: the MLflow run until it exists, then the launcher's phase, then the ranks."""
    spec = _spec(mlflow=True)
    assert waiting_for(spec) == "starting: creating the MLflow run, starting 2 rank(s)"
    assert waiting_for(spec, "creating the MLflow run", run_made=True) == "starting: 2 rank(s)"
    assert waiting_for(spec, "starting the helper") == "starting: starting the helper, starting 2 rank(s)"
    assert waiting_for(spec, "ranks starting") == "starting: 2 rank(s)"
    assert waiting_for(_spec(mlflow=False)) == "starting: 2 rank(s)"


def test_a_private_variable_a_library_sets_keeps_the_world_of_hot_ranks(monkeypatch):
    """Importing MLflow adds _MLFLOW_TELEMETRY_SESSION_ID to os.environ: hot ranks stay the same world; a real
    variable (NCCL_DEBUG) makes another world."""
    from air_magic.calls.runner import world_key
    from air_magic.job import JobSpec

    spec = JobSpec(target=print, args=(), kwargs={}, name="f", world_size=2, accelerator_type="CPU", timeout=None)
    monkeypatch.delenv("_MLFLOW_TELEMETRY_SESSION_ID", raising=False)
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    before = world_key(spec)
    monkeypatch.setenv("_MLFLOW_TELEMETRY_SESSION_ID", "1f72ee83")
    assert world_key(spec) == before
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert world_key(spec) != before


def test_a_retired_supervisor_leaves_no_pipe_open(tmp_path):
    """A supervisor replaced as stale retires; once it has exited, its client's pipes are closed (no
    ResourceWarning)."""
    from air_magic.launch.local.launcher import SupervisorClient

    client = SupervisorClient(tmp_path / "supervisor.log", warm=False, keeper=Keeper())
    client.retire()
    client._reader.join(30)
    assert not client._reader.is_alive()
    assert client.proc.stdin is not None and client.proc.stdin.closed
    assert client.proc.stdout is not None and client.proc.stdout.closed
    assert client.proc.poll() is not None
