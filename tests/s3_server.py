"""The S3 API of the air_magic.data tests: moto's server on 127.0.0.1, as the `s3` fixture.

`s3`: moto's S3 server on 127.0.0.1, started once per pytest session that asks for it (tests/conftest.py
registers this module's fixtures). It sets
`AWS_ENDPOINT_URL` and dummy credentials in this process's environment, so
s3fs and boto3 here, in workers and in DataLoader workers reach the server
with no options; each test makes its own bucket with `s3.bucket()`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3:
    """The running server: its endpoint, and helpers to make buckets and upload files."""

    endpoint: str

    def fs(self):
        """A fresh s3fs filesystem talking to the server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True)

    def bucket(self) -> str:
        """A new empty bucket's name."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return name

    def upload(self, local: Path, url: str) -> None:
        """Copy every file under the directory `local` to `url` (s3://bucket/prefix)."""
        fs = self.fs()
        for path in sorted(local.rglob("*")):
            if path.is_file():
                fs.put_file(str(path), f"{url.rstrip('/')}/{path.relative_to(local).as_posix()}")


@pytest.fixture(scope="session")
def s3() -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 at a free port, for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in [*_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(_ENV)
    os.environ["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
    try:
        yield S3(os.environ["AWS_ENDPOINT_URL"])
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
