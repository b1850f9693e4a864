"""Backend conformance: file:// (a local directory), s3:// (SeaweedFS) and gs://
(fake-gcs-server) hold the same objects and must answer the same way (the buckets:
backend_harness.py; faults between a backend and its server: test_backend_faults.py)."""

from __future__ import annotations

import gzip
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import google.auth
import google.auth.exceptions
import pytest
import trio
from google.auth.credentials import AnonymousCredentials

from bucketfs.backends import gcs
from bucketfs.backends.base import (
    AccessDenied,
    Backend,
    BackendError,
    ListPage,
    NoSuchBucket,
    NotFound,
    TransientError,
    Unreachable,
    VersionChanged,
)
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.settings import BackendSettings
from bucketfs.backends.store import ObjectStore
from tests.backend_harness import (
    BIG,
    KINDS,
    OBJECTS,
    VIAS,
    GcsHarness,
    Harness,
    S3Harness,
    check_message,
    get,
    new_harness,
    utf8,
)
from tests.servers import GcsServer, S3Server


def model(prefix: str, delimiter: str | None) -> tuple[list[str], list[str]]:
    """(object keys, common prefixes) a listing of OBJECTS must return, in order."""
    objects, prefixes = [], set()
    for key in sorted(OBJECTS, key=utf8):
        rest = key.removeprefix(prefix)
        if not key.startswith(prefix) or not rest:
            continue
        if delimiter and delimiter in rest:
            prefixes.add(prefix + rest[: rest.index(delimiter) + 1])
        else:
            objects.append(key)
    return objects, sorted(prefixes, key=utf8)


def list_all(
    backend: Backend, prefix: str, delimiter: str | None, page_size: int
) -> tuple[list[str], list[str], list[ListPage]]:
    objects: list[str] = []
    prefixes: list[str] = []
    pages: list[ListPage] = []
    token = None
    while len(pages) < 100:
        page = backend.list_page(prefix, delimiter, token, page_size)
        pages.append(page)
        objects += [o.key for o in page.objects]
        prefixes += page.prefixes
        token = page.next_token
        if token is None:
            return objects, prefixes, pages
    raise AssertionError("the listing did not end")


# --- The buckets these tests read and change (their kinds: backend_harness.py) -------


@dataclass
class Populated:
    harness: Harness
    backend: Backend
    #: Wall-clock bounds of the uploads, in ns, for checking mtimes.
    written: tuple[int, int]


@pytest.fixture(scope="module", params=KINDS)
def populated(request: pytest.FixtureRequest) -> Iterator[Populated]:
    """A bucket holding OBJECTS, shared by the read-only tests of this module."""
    harness = new_harness(request, request.param)
    start = time.time_ns()
    for key, data in OBJECTS.items():
        harness.put(key, data)
    written = (start, time.time_ns())
    yield Populated(harness, harness.backend(), written)
    harness.close()


@pytest.fixture(params=KINDS)
def scratch(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """An empty bucket of each kind, for tests that change objects."""
    harness = new_harness(request, request.param)
    yield harness
    harness.close()


# --- Listing ---------------------------------------------------------------------------


def test_list_everything_without_delimiter(populated: Populated) -> None:
    objects, prefixes, _ = list_all(populated.backend, "", None, 1000)
    assert objects == sorted(OBJECTS, key=utf8)
    assert prefixes == []
    page = populated.backend.list_page("", None, None, 1000)
    assert {o.key: o.size for o in page.objects} == {k: len(v) for k, v in OBJECTS.items()}


@pytest.mark.parametrize("prefix", ["", "b/", "b/c/", "ünïcödé/", "nothing/", "b", "a", "e"])
def test_list_with_delimiter(populated: Populated, prefix: str) -> None:
    """Objects and common prefixes directly under `prefix`, in UTF-8 order; a prefix that
    is part of a name ("b" covers "b/", "ba.txt" and "big.bin") works like any other."""
    objects, prefixes, _ = list_all(populated.backend, prefix, "/", 1000)
    assert (objects, prefixes) == model(prefix, "/")


@pytest.mark.parametrize("delimiter", [None, "/"])
def test_small_pages_reach_every_key_once(populated: Populated, delimiter: str | None) -> None:
    objects, prefixes, pages = list_all(populated.backend, "", delimiter, 2)
    want_objects, want_prefixes = model("", delimiter)
    if populated.harness.kind == "gcs" and delimiter:
        # fake-gcs-server quirk: with a delimiter, the page size counts objects only and
        # every page repeats all the common prefixes after its start. Real GCS counts
        # both and never repeats one.
        prefixes = list(dict.fromkeys(prefixes))
    assert sorted(objects, key=utf8) == want_objects
    assert sorted(prefixes, key=utf8) == want_prefixes
    if delimiter is None:
        assert all(len(p.objects) <= 2 and not p.prefixes for p in pages)
        assert len(pages) >= len(want_objects) // 2


# --- HEAD ------------------------------------------------------------------------------


def test_head_reports_size_mtime_and_a_stable_version(populated: Populated) -> None:
    backend = populated.backend
    listed = {o.key: o for o in backend.list_page("", None, None, 1000).objects}
    lo, hi = populated.written
    for key, data in OBJECTS.items():
        info = backend.head(key)
        assert (info.key, info.size) == (key, len(data))
        # S3 reports whole seconds.
        assert lo - 2 * 10**9 <= info.mtime_ns <= hi + 2 * 10**9, key
        assert info.version and backend.head(key).version == info.version
        assert listed[key].version == info.version
        assert listed[key].size == info.size


# Not "b/": SeaweedFS answers HEAD of an implicit directory with a 0-byte
# application/x-directory object where AWS answers 404; the mount never HEADs prefixes.
@pytest.mark.parametrize("key", ["no-such-key", "b", "ünïcödé/nope"])
def test_head_of_a_missing_key_is_not_found(populated: Populated, key: str) -> None:
    with pytest.raises(NotFound) as caught:
        populated.backend.head(key)
    check_message(caught.value, key)


# --- Ranged GET ------------------------------------------------------------------------


def test_remote_backends_get_through_libcurl_in_the_daemon(populated: Populated) -> None:
    fetch = getattr(populated.backend, "async_get_range", None)
    assert (fetch is not None) == (populated.harness.kind != "file")
    if fetch is not None:
        version = populated.backend.head("a.txt").version
        data = trio.run(fetch, "a.txt", version, 0, 6)
        assert isinstance(data, memoryview) and bytes(data) == b"alpha\n"


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize(
    ("start", "length"),
    [(0, 1), (len(BIG) - 1, 1), (0, len(BIG)), (12_345, 54_321), (len(BIG) - 10, 10), (7, 0)],
)
def test_get_range(populated: Populated, start: int, length: int, via: str) -> None:
    version = populated.backend.head("big.bin").version
    data = get(populated.backend, via, "big.bin", version, start, length)
    assert data == BIG[start : start + length]


@pytest.mark.parametrize("via", VIAS)
def test_get_every_object_whole(populated: Populated, via: str) -> None:
    """Keys with spaces, unicode, '%', '+', '=', '&' and zero-byte objects round-trip."""
    for key, data in OBJECTS.items():
        info = populated.backend.head(key)
        assert get(populated.backend, via, key, info.version, 0, info.size) == data, key


@pytest.mark.parametrize("via", VIAS)
def test_stale_version_is_refused(scratch: Harness, via: str) -> None:
    backend = scratch.backend()
    scratch.put("obj", b"first version")
    old = backend.head("obj").version
    scratch.put("obj", b"second versio")  # same size: only the version tells them apart
    new = backend.head("obj").version
    assert new != old
    with pytest.raises(VersionChanged) as caught:
        get(backend, via, "obj", old, 0, 5)
    check_message(caught.value, "obj")
    assert get(backend, via, "obj", new, 0, 6) == b"second"
    scratch.delete("obj")
    with pytest.raises(VersionChanged):
        get(backend, via, "obj", new, 0, 6)


@pytest.mark.parametrize("via", VIAS)
def test_gcs_object_stored_gzip_encoded_reads_as_stored(request: pytest.FixtureRequest,
                                                        via: str) -> None:
    """`gcloud storage cp -Z` stores an object gzip-encoded. Its listed size is the stored
    size, so its bytes must be the stored ones, by any range. Asked without
    Accept-Encoding: gzip, GCS decompresses it and ignores the range (fake-gcs-server
    too), which the GETs refused."""
    harness = new_harness(request, "gcs")
    try:
        stored = gzip.compress(random.Random(3).randbytes(300_000) + b"text " * 20_000)
        blob = harness.server.client().bucket(harness.bucket).blob("data.jsonl.gz")
        blob.content_encoding = "gzip"
        blob.upload_from_string(stored, retry=None)
        backend = harness.backend()
        info = backend.head("data.jsonl.gz")
        assert info.size == len(stored)
        for start, length in [(0, len(stored)), (0, 10), (123_456, 54_321),
                              (len(stored) - 7, 7)]:
            assert get(backend, via, "data.jsonl.gz", info.version, start,
                       length) == stored[start:start + length]
    finally:
        harness.close()


@pytest.mark.parametrize("via", VIAS)
def test_a_store_ignoring_the_range_is_refused_at_once(request: pytest.FixtureRequest,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     via: str) -> None:
    """GCS without Accept-Encoding: gzip answers a ranged GET of a gzip-encoded object
    with the whole object, decompressed (a real server ignoring Range): an error, and not
    one worth retrying, on both GET paths."""
    monkeypatch.setattr(gcs, "_STORED_BYTES", {})
    harness = new_harness(request, "gcs")
    try:
        blob = harness.server.client().bucket(harness.bucket).blob("a.gz")
        blob.content_encoding = "gzip"
        blob.upload_from_string(gzip.compress(b"abc" * 1000), retry=None)
        backend = harness.backend()
        version = backend.head("a.gz").version
        store = ObjectStore(backend, max_workers=2, retry=RetryPolicy(3, base_delay=0.01))
        with pytest.raises(BackendError) as caught:
            if via == "backend":  # retry.py retries a TransientError only
                backend.get_range("a.gz", version, 10, 20)
            else:
                trio.run(store.get_range, "a.gz", version, 10, 20)
        assert not isinstance(caught.value, TransientError)
        assert "ignored the Range header" in str(caught.value)
        assert store.counts.retries == 0
    finally:
        harness.close()


# --- Access ----------------------------------------------------------------------------


def test_check_access(populated: Populated) -> None:
    populated.backend.check_access()


def test_missing_bucket(scratch: Harness) -> None:
    backend = scratch.missing_bucket()
    with pytest.raises(NoSuchBucket) as caught:
        backend.check_access()
    check_message(caught.value, "no-such")


@pytest.mark.parametrize(
    "env",
    [
        {"AWS_SECRET_ACCESS_KEY": "wrong-secret-0123456789abcdefghij"},
        {"AWS_ACCESS_KEY_ID": "AKIAUNKNOWNKEY000000"},
    ],
    ids=["wrong-secret", "unknown-key"],
)
def test_s3_bad_credentials_are_access_denied_without_leaking_them(
    s3_server: S3Server, env: dict[str, str]
) -> None:
    bucket = "t-" + uuid.uuid4().hex[:16]
    s3_server.create_bucket(bucket)
    s3_server.put(bucket, "k", b"v")
    harness = S3Harness(s3_server, bucket)
    backend = harness.backend(env=env)
    secrets = [s3_server.access_key, s3_server.secret_key, *env.values()]
    version = s3_server.client().head_object(Bucket=bucket, Key="k")["ETag"].strip('"')
    try:
        for call in (backend.check_access, lambda: backend.head("k"),
                     lambda: backend.get_range("k", version, 0, 1),
                     lambda: get(backend, "daemon", "k", version, 0, 1)):
            with pytest.raises(AccessDenied) as caught:
                call()
            check_message(caught.value, bucket, s3_server.endpoint)
            assert not any(s in str(caught.value) for s in secrets), str(caught.value)
    finally:
        harness.close()


def test_s3_without_credentials_is_access_denied(s3_server: S3Server) -> None:
    harness = S3Harness(s3_server, "some-bucket")
    nothing = {
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_CONFIG_FILE": os.devnull,
    }
    try:
        with pytest.raises(AccessDenied) as caught:
            harness.backend(env=nothing).check_access()
    finally:
        harness.close()
    check_message(caught.value, "some-bucket", "credentials")


def test_gcs_without_default_credentials_reads_anonymously(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_credentials(**_: Any) -> None:
        raise google.auth.exceptions.DefaultCredentialsError("none here")

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setattr(google.auth, "default", no_credentials)
    with caplog.at_level(logging.INFO, logger="bucketfs.backends.gcs"):
        credentials, project = gcs._credentials("pub", BackendSettings())
    assert isinstance(credentials, AnonymousCredentials)
    assert project == "anonymous"
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "gs://pub" in caplog.records[0].getMessage()


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return sock.getsockname()[1]


def test_s3_unreachable_endpoint(s3_server: S3Server) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    harness = S3Harness(s3_server, "some-bucket")
    try:
        with pytest.raises(Unreachable) as caught:
            harness.backend(endpoint_url=endpoint, connect_timeout=2).check_access()
    finally:
        harness.close()
    check_message(caught.value, "some-bucket", endpoint)


def test_gcs_unreachable_endpoint(gcs_server: GcsServer) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    harness = GcsHarness(gcs_server, "some-bucket")
    try:
        with pytest.raises(Unreachable) as caught:
            harness.backend(endpoint_url=endpoint, connect_timeout=2).check_access()
    finally:
        harness.close()
    check_message(caught.value, "some-bucket", endpoint)
