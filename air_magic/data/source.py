"""Where the files come from: one listing of a directory or fsspec URL, taken once.

`Listing` holds the sorted relative names, sizes and versions (ETag or
modification time) of the files under a root, and a fingerprint of names and
sizes that a saved DataLoader state is checked against. Local roots (a path or
`file://`) are marked local: their files are read in place, never copied.

Not for reading file contents: `cache.py` fetches remote files.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec  # type: ignore[import-untyped]
from fsspec.core import url_to_fs  # type: ignore[import-untyped]

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}


def parse_size(value: int | str | None) -> int | None:
    """Bytes from an int or a string such as "10GB", "512MiB", "1.5 TB" (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"a size must be a number of bytes or a string such as '10GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"a size must be positive, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; write bytes (an int) or e.g. '10GB', '512MiB'")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return size


def is_local(url: str) -> bool:
    """True for a plain path or a `file://` / `local://` URL."""
    protocol = url.split("://", 1)[0] if "://" in url else ""
    return protocol in ("", "file", "local")


def local_path(url: str) -> str:
    """The filesystem path of a local URL."""
    for prefix in ("file://", "local://"):
        if url.startswith(prefix):
            return url[len(prefix) :]
    return url


@dataclass(frozen=True)
class Listing:
    """The files under `root`, sorted by relative name, with their sizes and versions."""

    root: str
    protocol: str
    storage_options: dict[str, Any]
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    versions: tuple[str, ...]
    local: bool
    fingerprint: str = field(default="")

    def url(self, index: int) -> str:
        """Where file `index` is: a local path for local roots, else a full URL."""
        return self.root.rstrip("/") + "/" + self.names[index]

    def __len__(self) -> int:
        return len(self.names)


def filesystem(protocol: str, storage_options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    """A fresh fsspec filesystem for this process (no instance shared across a fork)."""
    return fsspec.filesystem(protocol, skip_instance_cache=True, **storage_options)


def list_files(
    url: str | os.PathLike[str],
    pattern: str | None = None,
    recursive: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Listing:
    """List the files under `url` once: sorted relative names, optionally recursive and glob-filtered.

    `pattern` is matched (fnmatch) against the name relative to the root; `*` also matches `/`.
    """
    url = os.fspath(url)
    options = dict(storage_options or {})
    local = is_local(url)
    if local:
        root = os.path.abspath(os.path.expanduser(local_path(url)))
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no directory at {url!r}")
        fs: Any = fsspec.filesystem("file")
        protocol = "file"
    else:
        fs, root = url_to_fs(url, skip_instance_cache=True, **options)
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        root = root.rstrip("/")
        if not fs.isdir(root):
            raise FileNotFoundError(f"no directory at {url!r}")
    if recursive:
        entries = fs.find(root, detail=True, withdirs=False)
    else:
        entries = {e["name"]: e for e in fs.ls(root, detail=True) if e.get("type") == "file"}
    prefix = fs._strip_protocol(root).rstrip("/") + "/"
    rows = []
    for name, info in entries.items():
        stripped = fs._strip_protocol(name)
        rel = stripped[len(prefix) :] if stripped.startswith(prefix) else os.path.basename(stripped)
        if pattern is not None and not fnmatch.fnmatchcase(rel, pattern):
            continue
        version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
        rows.append((rel, int(info.get("size") or 0), str(version)))
    rows.sort()
    if not rows:
        raise FileNotFoundError(f"no files under {url!r}" + (f" match {pattern!r}" if pattern else ""))
    names = tuple(r[0] for r in rows)
    sizes = tuple(r[1] for r in rows)
    digest = hashlib.sha256()
    for name, size in zip(names, sizes):
        digest.update(f"{name}\0{size}\n".encode())
    full_root = root if local else f"{protocol}://{root}"
    mtimes = tuple(r[2] for r in rows)
    return Listing(full_root, protocol, options, names, sizes, mtimes, local, digest.hexdigest()[:32])
