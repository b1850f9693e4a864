"""Faults between a backend and a real server (SeaweedFS, fake-gcs-server), injected
with FaultProxy in front of it; retries through ObjectStore; a local file changed while
it is read."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from bucketfs.backends.base import Backend, TransientError, VersionChanged
from bucketfs.backends.local import LocalBackend
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from tests.backend_harness import BIG, GcsHarness, S3Harness, check_message, get, new_harness
from tests.faultproxy import FaultProxy


@dataclass
class Proxied:
    harness: S3Harness | GcsHarness
    proxy: FaultProxy
    backend: Backend


@pytest.fixture(scope="module", params=["s3", "gcs"])
def remote(request: pytest.FixtureRequest) -> Iterator[S3Harness | GcsHarness]:
    """A bucket with two objects on a real server (the first write to a new SeaweedFS
    bucket takes ~0.2 s, so it is shared)."""
    harness = new_harness(request, request.param)
    assert isinstance(harness, S3Harness | GcsHarness)
    for key in ("one", "two"):
        harness.put(key, BIG[:100_000])
    yield harness
    harness.close()


@pytest.fixture
def proxied(remote: S3Harness | GcsHarness, fault_proxy: Any) -> Proxied:
    """That bucket read through a fresh FaultProxy."""
    proxy = fault_proxy(remote.server.endpoint, flavor=remote.kind)
    return Proxied(remote, proxy, remote.backend(endpoint_url=proxy.endpoint))


def run_op(backend: Backend, op: str, version: str) -> object:
    if op == "get":
        return backend.get_range("one", version, 0, 100_000)
    if op == "daemon-get":
        return get(backend, "daemon", "one", version, 0, 100_000)
    if op == "head":
        return backend.head("one")
    return backend.list_page("", None, None, 1000)


# A HEAD response has no body to cut, so "truncate" applies to GET and LIST only.
@pytest.mark.parametrize(
    ("op", "action"),
    [(op, action) for op in ("get", "daemon-get", "head", "list")
     for action in ("status:503", "status:500", "drop", "truncate", "delay:2")
     if (op, action) != ("head", "truncate")],
)
def test_faults_are_transient(proxied: Proxied, op: str, action: str) -> None:
    """Each fault is a TransientError (never short data); the next attempt succeeds."""
    version = proxied.backend.head("one").version
    faulted = proxied.backend
    if action.startswith("delay:"):
        # Only the delayed call gets a read timeout shorter than the delay: a short one
        # everywhere fails healthy calls on a busy machine.
        faulted = proxied.harness.backend(endpoint_url=proxied.proxy.endpoint, read_timeout=0.5)
    proxied.proxy.add_rule(action=action, times=1)
    with pytest.raises(TransientError) as caught:
        run_op(faulted, op, version)
    check_message(caught.value, proxied.harness.bucket)
    if proxied.harness.kind == "s3":
        server = proxied.harness.server
        assert server.secret_key not in str(caught.value)
        assert server.access_key not in str(caught.value)
    result = run_op(proxied.backend, op, version)
    if op in ("get", "daemon-get"):
        assert bytes(result) == BIG[:100_000]


def test_zero_length_read_sends_no_request(proxied: Proxied) -> None:
    version = proxied.backend.head("one").version
    before = len(proxied.proxy.requests)
    assert proxied.backend.get_range("one", version, 50, 0) == b""
    assert get(proxied.backend, "daemon", "one", version, 50, 0) == b""
    assert len(proxied.proxy.requests) == before


# --- Retries through ObjectStore -------------------------------------------------------

POLICY = RetryPolicy(attempts=4, base_delay=0.01)


def test_store_retries_injected_503s_to_success(proxied: Proxied) -> None:
    info = proxied.backend.head("one")
    path = proxied.harness.path_of("one")
    downloads = proxied.proxy.count(path_contains=path)
    proxied.proxy.add_rule(method="GET", path_contains=path, action="status:503", times=2)
    store = ObjectStore(proxied.backend, max_workers=2, retry=POLICY)

    data = trio.run(store.get_range, "one", info.version, 0, info.size)

    assert data == BIG[:100_000]
    assert (store.counts.get, store.counts.retries) == (3, 2)
    assert proxied.proxy.count(path_contains=path) == downloads + 3


def test_store_gives_up_after_the_attempt_budget(proxied: Proxied) -> None:
    one, two = proxied.backend.head("one"), proxied.backend.head("two")
    path = proxied.harness.path_of("one")
    downloads = proxied.proxy.count(path_contains=path)
    proxied.proxy.add_rule(method="GET", path_contains=path, action="status:503")
    store = ObjectStore(proxied.backend, max_workers=2, retry=POLICY)

    with pytest.raises(TransientError):
        trio.run(store.get_range, "one", one.version, 0, one.size)
    assert proxied.proxy.count(path_contains=path) == downloads + POLICY.attempts
    # Another key is unaffected.
    assert trio.run(store.get_range, "two", two.version, 0, 10) == BIG[:10]


def test_a_local_file_rewritten_in_place_during_a_read_is_refused(tmp_path, monkeypatch):
    # A writer changing the file in place (not by a rename) between the version check
    # and the read would hand back bytes of two versions: the version is checked again.
    (tmp_path / "f.bin").write_bytes(b"a" * 1000)
    backend = LocalBackend(tmp_path)
    version = backend.head("f.bin").version
    real_pread = os.pread

    def pread_then_rewrite(fd, length, offset):
        data = real_pread(fd, length, offset)
        with open(tmp_path / "f.bin", "r+b") as f:
            f.write(b"b" * 10)
        os.utime(tmp_path / "f.bin", ns=(1, 1))
        return data

    monkeypatch.setattr(os, "pread", pread_then_rewrite)
    with pytest.raises(VersionChanged, match="while it was read"):
        backend.get_range("f.bin", version, 0, 100)
