"""The MLflow package's plain parts, without kernels: the two line formats, the private-name layer, Jupyter's URL."""

from __future__ import annotations

import json
import stat
import sys
import threading
from pathlib import Path

import pytest

from air_magic.jupyter import absolute_proxy_path, jupyter_base_url
from air_magic.launch.files.rundir import RunDir
from air_magic.tracking import _compat, tee

ROOT = Path(__file__).resolve().parents[2]


def test_chart_lines_round_trip_and_are_private(tmp_path):
    """What a rank's tee writes, the charts' reader reads back: key, value, step (or None) and a time stamp."""
    path = RunDir(tmp_path).chart_metrics(3)
    writer = tee.TeeWriter(path)
    writer.write([("loss", 0.5, 1), ("acc", 1, None)])
    writer.write([(7, 2.0**60, 2)])
    points = [tee.decode(line) for line in path.read_bytes().splitlines()]
    assert [(p.key, p.value, p.step) for p in points] == [("loss", 0.5, 1.0), ("acc", 1.0, None), ("7", 2.0**60, 2.0)]
    assert all(p.ts > 0 for p in points)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.name == "rank-3.metrics.jsonl" and path != RunDir(tmp_path).metrics(3)


def test_chart_reader_skips_what_is_not_a_finite_value():
    """Half lines, other JSON and non-finite values are no points (the charts skip them)."""
    for line in (
        b'{"key": "x", "value"',
        b"[]",
        b'{"value": 1}',
        b'{"key": "x", "value": NaN}',
        b'{"key": "x", "value": "Infinity"}',
        b'{"key": "x", "value": "soon"}',
    ):
        assert tee.decode(line) is None, line
    assert tee.decode(b'{"key": "x", "value": 1, "step": 4}') == ("x", 1.0, 4.0, 0.0)


def test_chart_writer_never_raises_for_a_value_that_is_not_a_number(tmp_path):
    """A value MLflow accepted but JSON cannot hold is dropped from the charts, never raised into the rank."""
    path = tmp_path / "m.jsonl"
    tee.TeeWriter(path).write([("x", object(), 1)])
    tee.TeeWriter(tmp_path / "missing" / "m.jsonl").write([("x", 1.0, 1)])
    assert not path.exists() or path.read_bytes() == b""


def test_chart_lines_of_two_threads_never_mix(tmp_path):
    """Each write is one line-aligned append, so concurrent writers leave only whole lines."""
    path = tmp_path / "m.jsonl"
    writer = tee.TeeWriter(path)
    threads = [
        threading.Thread(target=lambda k=k: [writer.write([(f"k{k}", i, i)] * 3) for i in range(200)]) for k in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = path.read_bytes().splitlines()
    assert len(lines) == 4 * 200 * 3 and all(tee.decode(line) is not None for line in lines)


def test_relay_lines_round_trip_through_the_relay_store(tmp_path, monkeypatch):
    """What the relay store in a rank writes, the notebook's reader turns back into the same metrics, params, tags."""
    from mlflow.entities import Metric, Param, RunTag

    from air_magic.tracking import relay

    monkeypatch.setenv("AIR_MAGIC_INTERNAL_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("AIR_MAGIC_MLFLOW_RUN_ID", "r1")
    relay.register()
    store = _compat.tracking_store(relay.URI)
    assert isinstance(store, relay.RelayStore) and store.path == RunDir(tmp_path).metrics(1)
    store.log_metric("r1", Metric("loss", 0.25, 1000, 3))
    store.log_batch("r1", [Metric("acc", 1.0, 1001, 4)], [Param("lr", "0.1")], [RunTag("t", "v")])
    offset, lines = relay.read_batches(store.path, 0)
    assert offset == store.path.stat().st_size
    batches = [relay.decode_batch(line) for line in lines]
    assert batches[0] == relay.Batch(metrics=[("loss", 0.25, 1000, 3)])
    assert batches[1] == relay.Batch([("acc", 1.0, 1001, 4)], [("lr", "0.1")], [("t", "v")])
    with open(store.path, "ab") as f:
        f.write(b'{"metrics": [')  # a line still being written
    assert relay.read_batches(store.path, offset) == (offset, [])
    with pytest.raises((ValueError, KeyError, TypeError)):
        relay.decode_batch(b'{"metrics": [["x"]]}')
    assert relay.read_batches(tmp_path / "none", 5) == (5, [])


def test_a_hot_ranks_next_call_logs_to_its_own_relay_and_chart_files(tmp_path, monkeypatch):
    """A hot rank patches mlflow at its first call; what its next call (another run directory, another run) logs
    goes to that call's relay and chart files, not to the first call's."""
    import mlflow

    from air_magic.tracking import hook, relay

    fluent = sys.modules["mlflow.tracking.fluent"]
    for module, name in (
        (mlflow, "log_metric"),
        (mlflow, "log_metrics"),
        (mlflow, "set_experiment"),
        (fluent, "set_experiment"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # put back after the test
    monkeypatch.setattr(hook, "_tee", {})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", relay.URI)
    monkeypatch.setenv("AIR_MAGIC_MLFLOW_RELAY", "1")
    monkeypatch.setenv("RANK", "0")
    for call, value in (("one", 1.0), ("two", 2.0)):
        (tmp_path / call).mkdir()
        monkeypatch.setenv("AIR_MAGIC_INTERNAL_RUN_DIR", str(tmp_path / call))
        monkeypatch.setenv("AIR_MAGIC_MLFLOW_RUN_ID", f"run-{call}")
        hook.install()  # as worker.run does at each call
        mlflow.log_metric("x", value, run_id=f"run-{call}")
        hook.reset()
    hook._tee["writer"].close()
    for call, value in (("one", 1.0), ("two", 2.0)):
        rd = RunDir(tmp_path / call)
        relayed = [relay.decode_batch(line).metrics for line in relay.read_batches(rd.metrics(0), 0)[1]]
        charted = [tee.decode(line) for line in rd.chart_metrics(0).read_bytes().splitlines()]
        assert [m[0][1] for m in relayed] == [value] and [p.value for p in charted if p] == [value], call


def test_every_private_mlflow_name_is_there_in_the_installed_mlflow(monkeypatch):
    """Each function of _compat works against the installed MLflow (an MLflow that moved a name fails here)."""
    import mlflow
    from mlflow.entities import Experiment

    class Store:
        def get_experiment(self, experiment_id):
            return Experiment(experiment_id, "seven", "", "active")

    _compat.register_tracking_store("air-magic-test", lambda store_uri=None, artifact_uri=None: Store())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "air-magic-test:")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "7")
    assert isinstance(_compat.tracking_store("air-magic-test:"), Store)
    assert _compat.experiment_id_from_env() == "7"
    assert _compat.active_experiment_id() is None
    assert _compat.active_run_stack() == []
    assert _compat.has_system_metrics_monitor() is False
    shut_down = _compat.shut_down_async_logging_function(mlflow)
    assert callable(shut_down) and shut_down is not mlflow.flush_async_logging


def test_jupyter_base_url_comes_from_the_parent_servers_runtime_file(tmp_path, monkeypatch):
    """The kernel's parent server's jpserver file gives the base URL; no file, no URL."""
    import jupyter_server_proxy  # noqa: F401 - a dependency: a broken install fails here

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("JPY_PARENT_PID", "424242")
    assert jupyter_base_url() is None
    (tmp_path / "jpserver-424242.json").write_text(json.dumps({"base_url": "/user/ann"}))
    assert jupyter_base_url() == "/user/ann/"
    assert absolute_proxy_path("/user/ann/", 5000) == "/user/ann/proxy/absolute/5000"
