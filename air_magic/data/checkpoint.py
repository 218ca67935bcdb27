"""`CheckpointWriter` / `CheckpointReader`: `torch.distributed.checkpoint` storage at any fsspec URL.

They are torch's `FileSystemWriter` / `FileSystemReader` with the file system
swapped: a local path (or `file://`) is written in place, with torch's own
fsync-then-rename; any other URL goes through a private local staging
directory. A file is written there, closed, uploaded with retries,
its remote size checked, and only then does the write return, so every stream
is complete before `save` (or the future of `async_save`) returns. `.metadata`
is published last, by a rename of a finished temporary object, and an
existing checkpoint's `.metadata` is removed before any of its files is
overwritten, so an interrupted save never loads, not even as a mix of old and new.

Not for the training state itself: use `torch.distributed.checkpoint.state_dict`
(`get_state_dict` / `set_state_dict`) to build what is saved.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

from fsspec.core import url_to_fs  # type: ignore[import-untyped]
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan

from .source import is_local, local_path

T = TypeVar("T")


class _StagedFileSystem(FileSystemBase):
    """An fsspec location reached through local files: written locally, then uploaded whole; read after a download."""

    def __init__(self, staging_dir: str | None, storage_options: dict[str, Any], retries: int, backoff: float) -> None:
        self.staging_root = staging_dir
        self.storage_options = storage_options
        self.retries = retries
        self.backoff = backoff
        self.fs: Any = None
        self._staging: str | None = None

    def _stage_dir(self) -> str:
        if self._staging is None or not os.path.isdir(self._staging):
            if self.staging_root:
                os.makedirs(self.staging_root, mode=0o700, exist_ok=True)
            self._staging = tempfile.mkdtemp(prefix="air_magic-dcp-", dir=self.staging_root)  # mode 0700
        return self._staging

    def _retry(self, what: str, url: str, action: Callable[[], T]) -> T:
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * (2 ** (attempt - 1)) * (0.5 + random.random()))
            try:
                return action()
            except Exception as exc:  # noqa: BLE001 - a failed remote call is retried, then reported with its URL
                last = exc
        attempts = self.retries + 1
        raise OSError(f"could not {what} {url} after {attempts} attempts: {type(last).__name__}: {last}") from last

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str:
        url = os.fspath(path)
        self.fs, _ = url_to_fs(url, **self.storage_options)
        return url.rstrip("/")

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return os.fspath(path).rstrip("/") + "/" + suffix

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        url = os.fspath(path)
        fd, local = tempfile.mkstemp(dir=self._stage_dir(), suffix="-" + url.rsplit("/", 1)[-1])
        os.close(fd)
        try:
            if "r" in mode:
                self._retry("download", url, lambda: self.fs.get_file(url, local))
                with open(local, mode) as stream:
                    yield cast(io.IOBase, stream)
                return
            with open(local, mode) as stream:
                yield cast(io.IOBase, stream)
            # Closed (torch may close it itself): complete on local disk. The upload is checked below.
            size = os.path.getsize(local)

            def upload() -> None:
                self.fs.put_file(local, url)
                self.fs.invalidate_cache(url)
                got = self.fs.size(url)
                if got != size:
                    raise OSError(f"{url} holds {got} bytes after the upload, {size} were written")

            self._retry("upload", url, upload)
        finally:
            try:
                os.remove(local)
            except FileNotFoundError:
                pass

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        src, dst = os.fspath(path), os.fspath(new_path)
        self._retry("rename", src, lambda: self.fs.mv(src, dst))
        self.fs.invalidate_cache()

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self.fs.makedirs(os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            url_to_fs(os.fspath(checkpoint_id))
        except (ValueError, ImportError):
            return False
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        self.fs.invalidate_cache(os.fspath(path))
        return bool(self.fs.exists(os.fspath(path)))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self._retry("delete", os.fspath(path), lambda: self.fs.rm(os.fspath(path)))

    def close(self) -> None:
        """Remove the staging directory."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def __del__(self) -> None:
        self.close()


class CheckpointWriter(FileSystemWriter):
    """Where `dcp.save(state, storage_writer=CheckpointWriter(url))` (or `async_save`) writes.

    path: a local directory, `file://...`, or any fsspec URL (`s3://bucket/ckpt/epoch-3`).
    overwrite: replace a checkpoint already there (its `.metadata` goes first); False = error.
    staging_dir: where remote files are staged before upload (default: a private temporary directory).
    storage_options: passed to fsspec. retries, backoff: remote calls are retried with backoff, then
    fail naming the URL. Other keyword arguments go to torch's FileSystemWriter (e.g. thread_count).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = True,
        staging_dir: str | None = None,
        storage_options: dict[str, Any] | None = None,
        retries: int = 5,
        backoff: float = 0.5,
        **kwargs: Any,
    ) -> None:
        url = os.fspath(path)
        remote = not is_local(url)
        super().__init__(url if remote else local_path(url), overwrite=overwrite, **kwargs)
        if remote:
            self.fs = cast(Any, _StagedFileSystem(staging_dir, dict(storage_options or {}), retries, backoff))
            self.path = self.fs.init_path(url)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.fs.mkdir(self.path)
        if self._metadata_exists() and not self.overwrite:
            raise FileExistsError(f"a checkpoint already exists at {self.path} and overwrite=False")
        if self.rank is not None and not self.use_collectives:
            return _prefixed(plan, self.rank)  # no coordinator: each rank names its own files
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator runs this after every rank planned and before any rank writes: unpublish the old checkpoint.
        if self.overwrite and self._metadata_exists():
            self.fs.rm_file(self._get_metadata_path())
        return super().prepare_global_plan(plans)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _StagedFileSystem.validate_checkpoint_id(checkpoint_id)


def _prefixed(plan: SavePlan, rank: int) -> SavePlan:
    import dataclasses

    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    return dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{rank}_"))


class CheckpointReader(FileSystemReader):
    """Where `dcp.load(state, storage_reader=CheckpointReader(url))` reads, on any number of ranks.

    Takes the same location and options as `CheckpointWriter`; remote files are downloaded to a
    private staging directory, read, and removed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        staging_dir: str | None = None,
        storage_options: dict[str, Any] | None = None,
        retries: int = 5,
        backoff: float = 0.5,
        **kwargs: Any,
    ) -> None:
        url = os.fspath(path)
        remote = not is_local(url)
        super().__init__(url if remote else local_path(url), **kwargs)
        if remote:
            self.fs = cast(Any, _StagedFileSystem(staging_dir, dict(storage_options or {}), retries, backoff))
            self.path = self.fs.init_path(url)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _StagedFileSystem.validate_checkpoint_id(checkpoint_id)
