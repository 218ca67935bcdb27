"""The workload file of `air-magic run -f`: the runtime's field names, overrides, and errors that name the field."""

from __future__ import annotations

import pytest

from air_magic.cli.jobfile import JobFileError, load, run_command


def _write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_a_command_job_becomes_a_spec_of_its_compute_with_code_source_path(tmp_path):
    """compute, code_source, max_retries and timeout become the JobSpec the notebook doors build."""
    (tmp_path / "src").mkdir()
    path = _write(
        tmp_path,
        "experiment_name: e\nmlflow_run_name: r\ncompute: {num_accelerators: 2, accelerator_type: CPU}\n"
        "command: echo hi\ncode_source: {root_path: src}\nmax_retries: 1\ntimeout: 60\n",
    )
    job = load(path)
    spec = job.spec()
    assert (spec.name, spec.world_size, spec.accelerator_type, spec.max_restarts, spec.timeout) == (
        "r",
        2,
        "CPU",
        1,
        60,
    )
    assert spec.target is run_command and spec.args == ("echo hi", str(tmp_path / "src"))
    assert spec.extra_env["CODE_SOURCE_PATH"] == str(tmp_path / "src")
    assert job.experiment_name == "e"


def test_an_override_changes_a_nested_field(tmp_path):
    """--override compute.num_accelerators=1 wins over the file."""
    path = _write(tmp_path, "compute: {num_accelerators: 2, accelerator_type: CPU}\ncommand: 'true'\n")
    assert load(path, ["compute.num_accelerators=1"]).spec().world_size == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("compute: {num_acelerators: 2}\ncommand: x\n", r"unknown field 'compute.num_acelerators'; did you mean "),
        ("comand: x\n", r"unknown field 'comand'; did you mean 'command'"),
        ("command: x\nfunction: m:f\n", "exactly one of 'command'"),
        ("compute: {num_accelerators: two}\ncommand: x\n", "compute.num_accelerators must be int"),
        ("command: x\nenvironment: {dependencies: [no-such-package-xyz]}\n", "'no-such-package-xyz' is not installed"),
        ("command: x\nenvironment: {dependencies: ['pyyaml<1']}\n", "'pyyaml<1' is not satisfied"),
        ("command: x\ncode_source: {root_path: nowhere}\n", "code_source.root_path: no such directory"),
        ("function: nomodule\n", "function must be 'module:name'"),
    ],
)
def test_a_bad_file_is_an_error_naming_the_field(tmp_path, text, message):
    """Each mistake is one JobFileError whose message names what to fix."""
    with pytest.raises(JobFileError, match=message):
        load(_write(tmp_path, text))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(JobFileError, match="no such job file"):
        load(tmp_path / "nope.yaml")
