"""Shared fixtures. The logic lives in tests/servers.py and tests/faultproxy.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.faultproxy import FaultProxy, Signer
from tests.servers import GcsServer, S3Server

# --- Real object stores (started on first use, once per session) --------------------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """SeaweedFS with authentication; buckets persist for the session, so name them uniquely."""
    with S3Server() as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GcsServer]:
    """fake-gcs-server; buckets persist for the session, so name them uniquely."""
    with GcsServer() as server:
        yield server


# --- Fault injection -----------------------------------------------------------------


@pytest.fixture
def fault_proxy() -> Iterator[Callable[..., FaultProxy]]:
    """Factory: fault_proxy(upstream_endpoint, flavor="s3", signer=None) -> a started
    FaultProxy in front of that "http://host:port"; every proxy made is stopped at the
    end of the test."""
    proxies: list[FaultProxy] = []

    def make(upstream: str, flavor: str = "s3", signer: Signer | None = None) -> FaultProxy:
        parts = urlsplit(upstream)
        assert parts.hostname and parts.port, f"not an http://host:port endpoint: {upstream}"
        proxy = FaultProxy(parts.hostname, parts.port, flavor=flavor, signer=signer).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.stop()


# --- Tests that need privileges ------------------------------------------------------
#
# `fuse`: the test mounts a FUSE filesystem (root, or a user who may open /dev/fuse and
# run fusermount3). `root`: it needs root itself (dropping the page cache, mounting a
# tmpfs or a loop device, acting as another user, kernel settings). Without them the
# test is skipped with the reason; the rest of the suite runs as any user.


def _fuse_usable() -> bool:
    if shutil.which("fusermount3") is None:
        return False
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = os.geteuid() == 0
    fuse = root or _fuse_usable()
    needs_root = pytest.mark.skip(reason="needs root (see README: running the tests)")
    needs_fuse = pytest.mark.skip(reason="needs FUSE: this user cannot open /dev/fuse")
    for item in items:
        if "root" in item.keywords and not root:
            item.add_marker(needs_root)
        elif "fuse" in item.keywords and not fuse:
            item.add_marker(needs_fuse)


@pytest.fixture
def one_file_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block the SSD tier stores is a file of its own: none counts as small
    enough to share a write-through chunk (as with large blocks, or while hints choose
    what is kept). For tests about block files themselves."""
    monkeypatch.setattr("bucketfs.cache.disk.CHUNKED_BELOW", 0)


@pytest.fixture
def disk_path(tmp_path):
    """A scratch directory on a file system whose pages can be dropped: tmp_path, or,
    where that is a tmpfs (which keeps every page), one beside the checkout."""
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True,
                          text=True, check=True).stdout.strip()
    if kind != "tmpfs":
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent) as directory:
        yield Path(directory)
