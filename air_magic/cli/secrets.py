"""The local store of a workload file's `secrets: {NAME: scope/key}`: where each value is read on this machine.

The runtime reads secrets from the workspace's secret scopes; here a secret `scope/key` is, first, the
environment variable `AIR_MAGIC_SECRET_<SCOPE>_<KEY>` (upper-cased, every other character than a letter or
digit as `_`), else the entry `{scope: {key: value}}` of the YAML file `$AIR_MAGIC_SECRETS_FILE`
(default `~/.config/air_magic/secrets.yaml`), which must be readable by its owner only (mode 0600).
`resolve(secrets)` gives every value, or one `JobFileError` naming each secret it could not find and where it
looked, before anything starts. Values are never printed. Not for: the fields' form (cli/schema.py).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from ..envvars import SECRET_PREFIX, SECRETS_FILE
from .schema import JobFileError


def env_name(ref: str) -> str:
    """The environment variable of secret `scope/key`: AIR_MAGIC_SECRET_SCOPE_KEY."""
    scope, _, key = ref.partition("/")
    return SECRET_PREFIX + re.sub(r"[^A-Z0-9]", "_", f"{scope}_{key}".upper())


def store_path() -> Path:
    return Path(os.environ.get(SECRETS_FILE) or "~/.config/air_magic/secrets.yaml").expanduser()


def _file_store() -> dict[str, Any]:
    import yaml

    path = store_path()
    if not path.exists():
        return {}
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise JobFileError(
            f"the secrets file {path} can be read by others (mode {stat.S_IMODE(mode):o}); make it yours only: "
            f"chmod 600 {path}"
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise JobFileError(f"cannot read the secrets file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise JobFileError(f"the secrets file {path} must be a mapping of scopes to mappings of keys to values")
    return data


def resolve(secrets: dict[str, str]) -> dict[str, str]:
    """{NAME: value} of every secret; JobFileError naming the missing ones (and where each is looked for)."""
    if not secrets:
        return {}
    store: dict[str, Any] | None = None
    values, missing = {}, []
    for name, ref in secrets.items():
        if env_name(ref) in os.environ:
            values[name] = os.environ[env_name(ref)]
            continue
        store = _file_store() if store is None else store
        scope, _, key = ref.partition("/")
        found = (store.get(scope) or {}).get(key) if isinstance(store.get(scope), dict) else None
        if found is None:
            missing.append(f"{name} ({ref}: set {env_name(ref)}, or {scope}: {{{key}: ...}} in {store_path()})")
        else:
            values[name] = str(found)
    if missing:
        raise JobFileError(f"secrets not found on this machine: {'; '.join(missing)}")
    return values


def sources(secrets: dict[str, str]) -> dict[str, str]:
    """Each secret's reference and whether this machine has it (never its value)."""
    found = {}
    for name, ref in secrets.items():
        try:
            resolve({name: ref})
            found[name] = f"{ref} (found)"
        except JobFileError:
            found[name] = f"{ref} (missing: set {env_name(ref)}, or add it to {store_path()})"
    return found
