"""Every field of a workload file, by the runtime's names, and what becomes of the ones that do not run here.

`FIELDS` is the tree of fields with the kind of each value, in the order the runtime checks them; `EXTENSIONS`
are air_magic's own fields; `IGNORED` the ones accepted and named in one notice (no meaning on one machine);
`RENAMED` the names of older schemas with the field that replaced them; `REFUSED` newer fields that cannot run
here. Not for: the checks (cli/schema.py).
"""

from __future__ import annotations

from typing import Any

#: Kinds of a field's value.
STR, INT, BOOL, LIST, MAP, ANY = "a string", "a whole number", "true or false", "a list", "a mapping", "any value"

#: Every field of the file: a kind, or a mapping of the section's fields. Declaration order is check order.
FIELDS: dict[str, Any] = {
    "experiment_name": STR,
    "compute": {
        "num_accelerators": INT,
        "accelerator_type": STR,
        "pool_id": STR,
        "priority_class": STR,
        "num_nodes": INT,
    },
    "environment": {
        "dependencies": ANY,
        "version": ANY,
        "docker_image": {"url": STR, "tag_policy": STR, "credentials_scope": STR, "credentials_key": STR},
    },
    "command": STR,
    "function": STR,
    "args": LIST,
    "kwargs": MAP,
    "env_variables": MAP,
    "secrets": MAP,
    "code_source": {
        "type": STR,
        "snapshot": {
            "root_path": STR,
            "remote_volume": STR,
            "git": {"branch": STR, "commit": STR, "remote": ANY},
            "include_paths": LIST,
        },
    },
    "max_retries": INT,
    "timeout_minutes": INT,
    "idempotency_token": STR,
    "parameters": MAP,
    "mlflow_run_name": STR,
    "mlflow_experiment_directory": STR,
    "permissions": LIST,
    "usage_policy_name": STR,
    "usage_policy_id": STR,
}

#: air_magic's own fields: not the runtime's, documented as such (docs/cli.md).
EXTENSIONS = ("function", "args", "kwargs", "compute.num_nodes")

#: Fields accepted and named in one notice: they have no meaning on one machine.
IGNORED = (
    "environment.docker_image",
    "environment.version",
    "code_source.snapshot.remote_volume",
    "permissions",
    "usage_policy_name",
    "usage_policy_id",
    "compute.pool_id",
    "compute.priority_class",
    "mlflow_experiment_directory",
)

#: Names of older schemas, refused with the field that replaced them.
RENAMED = {
    "timeout": "timeout_minutes (minutes per attempt)",
    "run_name": "mlflow_run_name",
    "bash_script": "command",
    "env_variables_secrets": "secrets",
    "priority": "compute.priority_class",
    "budget_policy_id": "usage_policy_id",
    "compute.gpus": "compute.num_accelerators",
    "compute.gpu_type": "compute.accelerator_type (GPU_1xA10, GPU_1xH100, GPU_8xH100)",
    "compute.gpu_pool_name": "compute.pool_id",
    "compute.gpu_node_pool_id": "compute.pool_id",
    "environment.env_variables": "env_variables (top level)",
    "code_source.snapshot.repo_path": "code_source.snapshot.root_path",
    "code_source.snapshot.git_branch": "code_source.snapshot.git.branch",
    "code_source.snapshot.git_commit": "code_source.snapshot.git.commit",
    "code_source.snapshot.allow_uncommitted": "code_source.snapshot without git (the working tree as it is)",
    "code_source.root_path": "code_source: {type: snapshot, snapshot: {root_path: ...}}",
}

#: Fields of newer runtime versions that do not run on one machine, refused with why.
REFUSED = {
    "schedule": "a schedule makes a recurring job on the workspace; run the file from cron instead",
    "containers": "several containers per node are not supported; give one command",
    "environment.unity_catalog_image": "a Unity Catalog image needs the workspace; leave it out",
    "mlflow_artifact_location": "artifacts go to the local MLflow store's location; leave it out",
}
