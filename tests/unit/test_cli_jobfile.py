"""The workload file of `air-magic run -f`: the runtime's fields, defaults and messages, and the nodes a file asks
for. (The documented examples' --dry-run, which takes git snapshots: tests/test_cli_examples.py.)"""

from __future__ import annotations

import pytest

from air_magic.accelerators import Node
from air_magic.cli import topology
from air_magic.cli.jobfile import DEFAULT_MAX_RETRIES, JobFileError, load
from air_magic.cli.main import main, normalize

RUN = "experiment_name: e\ncompute: {num_accelerators: 2, accelerator_type: CPU}\ncommand: echo hi\n"


def _write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_a_command_file_leases_the_nodes_units_with_the_runtimes_defaults(tmp_path):
    """A command file is a call of a rank per unit of the node (leased together; its first runs the command),
    max_retries 3 when left out, and no call-wide time limit (timeout_minutes is each attempt's)."""
    job = load(_write(tmp_path, RUN + "timeout_minutes: 5\nparameters: {lr: 0.1}\nenv_variables: {A: true, B: 1e-3}\n"))
    settings = job.settings()
    assert job.node()["env_variables"] == {"A": "true", "B": "1e-3"}
    assert (settings.num_accelerators, settings.max_restarts, settings.timeout) == (2, DEFAULT_MAX_RETRIES, None)
    assert job.node()["local_world_size"] == 2 and job.node()["timeout_minutes"] == 5
    assert job.name == "e"


def test_num_accelerators_is_the_total_over_nodes_of_the_types_size():
    """16 x GPU_8xH100 is 2 nodes of 8; 3 x GPU_8xH100 is refused naming the multiple."""
    assert topology.of({"num_accelerators": 16, "accelerator_type": "GPU_8xH100"}) == topology.Topology(
        2, 8, "GPU_8xH100"
    )
    with pytest.raises(JobFileError, match="for GPU_8xH100 must be a multiple of 8, got 3"):
        topology.of({"num_accelerators": 3, "accelerator_type": "GPU_8xH100"})


@pytest.mark.parametrize(
    ("nodes", "node", "override"),
    [
        (topology.Topology(1, 8, "GPU_8xH100"), Node(0, None), "--override compute.accelerator_type=CPU"),
        (
            topology.Topology(1, 8, "GPU_8xH100"),
            Node(2, "H100"),
            "--override compute.accelerator_type=GPU_2xH100 --override compute.num_accelerators=2",
        ),
    ],
)
def test_a_node_this_machine_cannot_be_is_refused_naming_the_override_that_fits(nodes, node, override):
    """GPUs on a machine with none, or more GPUs than it has: one line ending in the override that fits; several
    nodes are a Ray cluster's, and the override that makes them one node is at hand for its message."""
    assert nodes.refusal(node).endswith(override)
    assert topology.Topology(1, 8, "GPU_8xH100").refusal(Node(8, "H100")) is None
    two = topology.Topology(2, 8, "GPU_8xH100")
    assert two.refusal(Node(0, None)) is None and two.one_node() == "--override compute.num_accelerators=8"
    assert topology.of({"num_accelerators": 4, "accelerator_type": "CPU", "num_nodes": 2}) == topology.Topology(
        2, 2, "CPU"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "compute: {num_acelerators: 2}\n",
            r"unknown field 'compute.num_acelerators'; did you mean 'num_accelerators'",
        ),
        ("comand: x\n", r"unknown field 'comand'; did you mean 'command'"),
        ("timeout: 60\n", r"'timeout' is not a field of the workload file; use timeout_minutes"),
        ("code_source: {root_path: .}\n", r"use code_source: \{type: snapshot"),
        ("code_source: {type: git, snapshot: {root_path: .}}\n", "code_source.type must be 'snapshot'"),
        ("code_source: {type: snapshot}\n", "code_source.snapshot is required"),
        ("code_source: {type: snapshot, snapshot: {root_path: nowhere}}\n", "root_path: no such directory"),
        ("code_source: {type: snapshot, snapshot: {root_path: ., git: {branch: a, commit: b}}}\n", "exactly one"),
        ("code_source: {type: snapshot, snapshot: {root_path: ., git: {branch: a, remote: true}}}\n", "no longer"),
        ("code_source: {type: snapshot, snapshot: {root_path: ., include_paths: ['../x']}}\n", "relative path"),
        ("env_variables: {A: '1'}\nsecrets: {A: s/k}\n", "A is in both env_variables and secrets"),
        ("secrets: {A: no-slash}\n", r"secrets.A must be 'scope/key'"),
        ("max_retries: -1\n", "max_retries must be 0 or more"),
        ("timeout_minutes: 0\n", "timeout_minutes must be >= 1"),
        ("experiment_name: a.b\n", "experiment_name must be 1 to 100 characters"),
        ("environment: {version: '4'}\n", "'environment.version' requires inline 'dependencies'"),
        ("environment: {docker_image: {url: x}, dependencies: [torch]}\n", "docker_image supplies the whole"),
        ("mlflow_experiment_directory: /Users/me\n", "must start with /Workspace"),
        ("usage_policy_id: abcd123-not-a-uuid\n", "usage_policy_id must be a UUID"),
        ("schedule: {quartz_cron_expression: x}\n", "'schedule' is not supported on this machine"),
        ("function: m:f\n", "give exactly one of 'command'"),
        ("compute: {num_accelerators: 2, accelerator_type: h100_80gb}\n", "accelerator_type must be one of"),
    ],
)
def test_a_bad_file_is_an_error_naming_the_field_and_the_fix(tmp_path, text, message):
    """Each mistake is one JobFileError whose message names the field and what to write."""
    with pytest.raises(JobFileError, match=message):
        load(_write(tmp_path, _merge(text)))


def _merge(text: str) -> str:
    """RUN with `text`'s top-level field added, in place of RUN's own if it has it."""
    key = text.split(":", 1)[0]
    kept = [line for line in RUN.splitlines() if not line.startswith(key + ":")]
    return "\n".join(kept) + "\n" + text


def test_an_override_says_what_it_changed(tmp_path):
    """--override compute.num_accelerators=1 wins over the file, and says the change as the runtime does."""
    said = []
    job = load(_write(tmp_path, RUN), ["compute.num_accelerators=1", "max_retries=0"], say=said.append)
    assert job.node()["local_world_size"] == 1 and job.max_retries == 0
    assert said == ["Override: changing compute.num_accelerators from 2 to 1", "Override: setting max_retries to 0"]


def test_fields_without_local_meaning_are_named_in_one_notice(tmp_path, capsys):
    """docker_image-free fields with no meaning here (permissions, a policy, a volume, a pool) are accepted; one
    stderr line names them all."""
    text = RUN.replace("accelerator_type: CPU}", "accelerator_type: CPU, pool_id: p1}")
    text += "usage_policy_name: team\npermissions: [{group_name: g, level: CAN_VIEW}]\n"
    assert main(["run", "-f", str(_write(tmp_path, text)), "--dry-run"]) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "notice" in line]
    assert notices == [
        "air-magic: notice: no meaning on this machine, ignored: permissions, usage_policy_name, compute.pool_id"
    ]


def test_output_flags_come_anywhere_and_the_docs_forms_are_aliases():
    """-o json, --output=json and --json anywhere on the line ask for JSON; `get run ID` is `get ID`."""
    assert normalize(["-o", "json", "get", "run", "X"]) == (["get", "X"], True)
    assert normalize(["list", "runs", "--active", "--output=json"]) == (["list", "--active"], True)
    assert normalize(["run", "-f", "j.yaml", "--override", "command=echo -o json"]) == (
        ["run", "-f", "j.yaml", "--override", "command=echo -o json"],
        False,
    )


def test_a_function_file_without_compute_passes_dry_run(tmp_path, capsys, monkeypatch):
    """`compute` is optional for a function workload (every GPU of this machine, or its CPU slots, as
    @distributed's default): --dry-run says so, and the file is one node (it was a KeyError traceback)."""
    (tmp_path / "hold.py").write_text("def main():\n    return 1\n")
    path = _write(tmp_path, "experiment_name: e\nfunction: hold:main\nmax_retries: 0\n")
    monkeypatch.chdir(tmp_path)
    assert load(path).num_nodes == 1
    assert main(["run", "-f", str(path), "--dry-run", "-o", "json"]) == 0, capsys.readouterr()
    assert '"status": "DRY_RUN_OK"' in capsys.readouterr().out
