"""One bucket on each kind of store, for the backend tests (test_backends.py,
test_backend_faults.py): file:// (a local directory), s3:// (SeaweedFS) and gs://
(fake-gcs-server), with backends for it and writes that go around them; the objects the
conformance tests read, and the two ways a GET is made."""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import quote

import pytest
import trio

from bucketfs.backends.base import Backend
from bucketfs.backends.gcs import GcsBackend
from bucketfs.backends.local import LocalBackend
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.s3 import S3Backend
from bucketfs.backends.settings import BackendSettings
from bucketfs.backends.store import ObjectStore
from tests.servers import GcsServer, S3Server

_rng = random.Random(7)
OBJECTS: dict[str, bytes] = {
    "100%.txt": b"percent\n",
    "a+b.txt": b"plus\n",
    "a.txt": b"alpha\n",
    "b/1.bin": _rng.randbytes(1000),
    "b/2.bin": _rng.randbytes(2000),
    "b/c/deep.txt": b"deep\n",
    "ba.txt": b"ba\n",
    "big.bin": _rng.randbytes(300_000),
    "empty": b"",
    "with space.txt": b"space\n",
    "x=1&y.txt": b"query-ish\n",
    "ünïcödé/文件.txt": b"unicode\n",
}
KINDS = ["file", "s3", "gcs"]
BIG = OBJECTS["big.bin"]


def utf8(key: str) -> bytes:
    return key.encode()


def check_message(exc: BaseException, *parts: str) -> None:
    """Errors are one line and name what failed."""
    text = str(exc)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, (part, text)


class Harness:
    """A bucket (or directory): backends for it, and writes that go around them."""

    kind = ""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self._opened: list[Backend] = []

    def backend(self, **settings: Any) -> Backend:
        backend = self._make(**settings)
        self._opened.append(backend)
        return backend

    def close(self) -> None:
        for backend in self._opened:
            backend.close()

    def _make(self, **settings: Any) -> Backend:
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def missing_bucket(self) -> Backend:
        raise NotImplementedError


class LocalHarness(Harness):
    kind = "file"

    def __init__(self, root: Path) -> None:
        super().__init__(str(root))
        self.root = root

    def _make(self, **settings: Any) -> Backend:
        return LocalBackend(self.root)

    def put(self, key: str, data: bytes) -> None:
        # Write then rename, as an uploader replacing an object would.
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.root.parent / f".put-{uuid.uuid4().hex}"
        staging.write_bytes(data)
        os.replace(staging, path)

    def delete(self, key: str) -> None:
        (self.root / key).unlink()

    def missing_bucket(self) -> Backend:
        return LocalBackend(self.root.parent / "no-such-directory")


class ServerHarness(Harness):
    """A bucket on one of the test servers (SeaweedFS, fake-gcs-server), written through
    the server's own client."""

    def __init__(self, server: S3Server | GcsServer, bucket: str) -> None:
        super().__init__(bucket)
        self.server = server

    def put(self, key: str, data: bytes) -> None:
        self.server.put(self.bucket, key, data)

    def delete(self, key: str) -> None:
        self.server.delete(self.bucket, key)

    def missing_bucket(self) -> Backend:
        return self.backend(bucket="no-such-bucket-" + uuid.uuid4().hex[:8])


class S3Harness(ServerHarness):
    kind = "s3"
    server: S3Server

    def _make(self, bucket: str | None = None, env: dict[str, str] | None = None,
              **settings: Any) -> Backend:
        # The standard credential chain, fed through the environment as a user would.
        with mock.patch.dict(os.environ, {**self.server.env(), **(env or {})}):
            return S3Backend(
                bucket or self.bucket, BackendSettings(addressing_style="path", **settings)
            )

    def path_of(self, key: str) -> str:
        return f"/{self.bucket}/{quote(key)}"


class GcsHarness(ServerHarness):
    kind = "gcs"
    server: GcsServer

    def _make(self, bucket: str | None = None, endpoint_url: str | None = None,
              **settings: Any) -> Backend:
        emulator = {"STORAGE_EMULATOR_HOST": endpoint_url or self.server.endpoint}
        with mock.patch.dict(os.environ, emulator):
            return GcsBackend(bucket or self.bucket, BackendSettings(**settings))

    def path_of(self, key: str) -> str:
        """What the path of a GET of `key` holds: obstore reads through the XML API,
        /BUCKET/KEY, and percent-encodes the bucket's "-" (t-HEX): its HEX part, then."""
        return f"{self.bucket.rpartition('-')[2]}/{quote(key)}"


def new_harness(request: pytest.FixtureRequest, kind: str) -> Harness:
    """An empty bucket of that kind; a fresh name, as the servers live for the session."""
    name = "t-" + uuid.uuid4().hex[:16]
    if kind == "file":
        root = request.getfixturevalue("tmp_path_factory").mktemp("bucket") / name
        root.mkdir()
        return LocalHarness(root)
    if kind == "s3":
        s3: S3Server = request.getfixturevalue("s3_server")
        s3.create_bucket(name)
        return S3Harness(s3, name)
    gcs: GcsServer = request.getfixturevalue("gcs_server")
    gcs.create_bucket(name)
    return GcsHarness(gcs, name)


#: How a GET is made: "backend" is the blocking call (obstore, in a worker thread);
#: "daemon" is what the mount makes, ObjectStore's, which for s3:// and gs:// is libcurl
#: on the trio thread (curl_gets.py).
VIAS = ["backend", "daemon"]


def get(backend: Backend, via: str, key: str, version: str, start: int,
        length: int) -> bytes:
    if via == "backend":
        return bytes(backend.get_range(key, version, start, length))
    store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(1))
    return bytes(trio.run(store.get_range, key, version, start, length))
