"""A ranged GET checks the version of what came back, not only the version it asked for.

The request pins the version (S3 If-Match; GCS generation and ifGenerationMatch), but a
store may ignore the precondition (fake-gcs-server ignores ifGenerationMatch). FaultProxy's
"unpin" plays such a store: it forwards the GET without the precondition (signed anew for
S3), so a real server answers 206 with the live version's bytes and its own ETag or
generation. The backend must refuse them (VersionChanged, EIO through a mount), and must
refuse a response that names no version at all rather than trust it.
"""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from bucketfs.backends.base import Backend, BackendError, TransientError, VersionChanged
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from tests.faultproxy import FaultProxy
from tests.mounting import mounted, read_log
from tests.servers import GcsServer, S3Server
from tests.sigv4 import sigv4_signer
from tests.test_backends import GcsHarness, S3Harness, new_harness

KiB, MiB = 1024, 1024**2
OLD, NEW = random.Random("old").randbytes(3 * MiB), random.Random("new").randbytes(3 * MiB)
#: The response header that names the version, per store.
VERSION_HEADER = {"s3": "etag", "gcs": "x-goog-generation"}


def unpinning_proxy(server: S3Server | GcsServer, flavor: str) -> FaultProxy:
    signer = None
    if isinstance(server, S3Server):
        signer = sigv4_signer(server.access_key, server.secret_key, server.region)
    host, port = server.endpoint.removeprefix("http://").split(":")
    return FaultProxy(host, int(port), flavor=flavor, signer=signer).start()


@dataclass
class Remote:
    harness: S3Harness | GcsHarness
    proxy: FaultProxy
    backend: Backend


@pytest.fixture(params=["s3", "gcs"])
def remote(request: pytest.FixtureRequest) -> Iterator[Remote]:
    """An empty bucket read through a FaultProxy able to unpin S3 and GCS requests."""
    harness = new_harness(request, request.param)
    assert isinstance(harness, S3Harness | GcsHarness)
    proxy = unpinning_proxy(harness.server, harness.kind)
    try:
        yield Remote(harness, proxy, harness.backend(endpoint_url=proxy.endpoint))
    finally:
        proxy.stop()
        harness.close()


def get_answers(proxy: FaultProxy, since: int = 0) -> list[int]:
    """Statuses of the object downloads the upstream answered, `since` a point (GCS
    metadata reads and listings are GETs of /storage/v1/...; downloads are not)."""
    return [status for method, path, status in proxy.answers[since:]
            if method == "GET" and not path.startswith("/storage/v1/")]


def test_unpinned_read_of_a_replaced_object_is_version_changed(remote: Remote) -> None:
    remote.harness.put("obj", OLD[:200_000])
    old = remote.backend.head("obj").version
    remote.harness.put("obj", NEW[:200_000])  # same size: only the version tells them apart
    new = remote.backend.head("obj").version
    assert new != old
    remote.proxy.add_rule(method="GET", action="unpin")
    store = ObjectStore(remote.backend, max_workers=2, retry=RetryPolicy(4, 0.01, 0.05))
    since = len(remote.proxy.answers)

    with pytest.raises(VersionChanged) as caught:
        trio.run(store.get_range, "obj", old, 1000, 5000)

    assert "obj" in str(caught.value) and "changed" in str(caught.value)
    # The store did answer with bytes (of the new version): only the check refused them,
    # once (a changed version is not worth retrying).
    assert get_answers(remote.proxy, since) == [206]
    assert (store.counts.get, store.counts.retries) == (1, 0)
    # The check lets the version that was asked for through.
    assert remote.backend.get_range("obj", new, 1000, 5000) == NEW[1000:6000]
    assert get_answers(remote.proxy, since) == [206, 206]


def test_a_response_that_names_no_version_is_refused(remote: Remote) -> None:
    remote.harness.put("plain", OLD[:50_000])
    version = remote.backend.head("plain").version
    remote.proxy.add_rule(method="GET", action=f"hide:{VERSION_HEADER[remote.harness.kind]}")
    store = ObjectStore(remote.backend, max_workers=2, retry=RetryPolicy(4, 0.01, 0.05))
    since = len(remote.proxy.answers)

    with pytest.raises(BackendError) as caught:
        trio.run(store.get_range, "plain", version, 0, 50_000)

    assert not isinstance(caught.value, TransientError | VersionChanged)
    assert "cannot be checked" in str(caught.value)
    assert get_answers(remote.proxy, since) == [206]
    assert store.counts.get == 1  # every answer of such a store would be the same
    remote.proxy.clear()
    assert remote.backend.get_range("plain", version, 0, 50_000) == OLD[:50_000]


# --- Through a mount -------------------------------------------------------------------


def open_uncached(path: Path) -> int:
    """An fd whose reads all reach the daemon: O_DIRECT bypasses the kernel's page cache
    and read-ahead on FUSE."""
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


@pytest.mark.fuse
@pytest.mark.parametrize(
    ("scheme", "unpin"),
    [("s3", True), ("gs", True), ("gs", False)],
    ids=["s3-ignores-if-match", "gs-ignores-generation", "gs-honours-generation"],
)
def test_mount_never_mixes_versions(scheme: str, unpin: bool, request: pytest.FixtureRequest,
                                    tmp_path: Path) -> None:
    """A handle opened on the old version fails with EIO once the object is replaced,
    whether the store refuses the old version (404/412) or ignores the precondition and
    answers with the new one; a new open reads the new version whole."""
    server: S3Server | GcsServer = request.getfixturevalue(
        "s3_server" if scheme == "s3" else "gcs_server")
    bucket = f"version-{scheme}-{'unpinned' if unpin else 'pinned'}"
    server.create_bucket(bucket)
    server.put(bucket, "file.bin", OLD)
    proxy = unpinning_proxy(server, "s3" if scheme == "s3" else "gcs")
    if unpin:
        proxy.add_rule(method="GET", action="unpin")
    if scheme == "s3":
        env = {**server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        args: tuple[str, ...] = ("--addressing-style", "path")
    else:
        env = {"STORAGE_EMULATOR_HOST": proxy.endpoint}
        args = ()
    try:
        with mounted(f"{scheme}://{bucket}", tmp_path / "mnt", *args, "--block-size", "256KiB",
                     "--readahead-max", "256KiB", "--retry-attempts", "3",
                     "--retry-base-delay", "0.01", env=env) as mnt:
            fd = open_uncached(mnt / "file.bin")
            try:
                assert os.pread(fd, 4 * KiB, 0) == OLD[:4 * KiB]
                server.put(bucket, "file.bin", NEW)
                before = len(proxy.answers)
                for _ in range(2):  # the failed read is not retried into the new bytes
                    with pytest.raises(OSError) as caught:
                        os.pread(fd, 64 * KiB, 2 * MiB)
                    assert caught.value.errno == errno.EIO
            finally:
                os.close(fd)
            answered = get_answers(proxy, before)
            # Unpinned, the store served the new version (206) and only the check stood in
            # the way; pinned, fake-gcs-server refused the old generation (404).
            assert answered and set(answered) == ({206} if unpin else {404}), answered
            assert "changed in the bucket" in read_log(tmp_path / "mnt.log")
            assert (mnt / "file.bin").read_bytes() == NEW
    finally:
        proxy.stop()
