"""Reading a workload file's YAML and changing it with `--override KEY=VALUE`, before its fields are checked.

Not for: the fields' meaning (cli/schema.py, cli/jobfile.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .schema import JobFileError


def read(file: Path) -> dict[str, Any]:
    """The mapping of the YAML file `file`, as the runtime accepts it (at most 1 MB, not empty, no `_bases_`)."""
    import yaml

    try:
        text = file.read_text()
    except FileNotFoundError:
        raise JobFileError(f"no such job file: {file}") from None
    except OSError as exc:
        raise JobFileError(f"cannot read the job file {file}: {exc.strerror or exc}") from None
    if len(text.encode()) > 1 << 20:
        raise JobFileError(f"{file} is larger than 1 MB")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobFileError(f"{file} is not valid YAML: {exc}") from None
    if data is None:
        raise JobFileError(f"{file} is empty; it needs experiment_name, compute and command")
    if not isinstance(data, dict):
        raise JobFileError(f"{file} must hold a mapping of fields (experiment_name, compute, command, ...)")
    if "_bases_" in data:
        raise JobFileError("_bases_ (composing files) is not supported; write the fields in one file")
    return data


def apply_override(data: dict[str, Any], text: str, say: Any = None) -> None:
    """`compute.num_accelerators=2` into `data` (the value read as YAML: 2 is a number, CPU a string)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise JobFileError(f"--override {text!r} must be KEY=VALUE, such as compute.num_accelerators=2")
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise JobFileError(f"--override {text!r}: {part} is not a section")
    try:
        new = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise JobFileError(f"--override {text!r}: the value is not valid: {exc}") from None
    if say is not None:
        said = (
            f"changing {key} from {node[parts[-1]]!r} to {new!r}" if parts[-1] in node else f"setting {key} to {new!r}"
        )
        say(f"Override: {said}")
    node[parts[-1]] = new
