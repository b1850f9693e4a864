"""Shared fixtures. The logic lives in tests/servers.py and tests/faultproxy.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest

from tests.faultproxy import FaultProxy
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
    """Factory: fault_proxy(upstream_endpoint, flavor="s3") -> a started FaultProxy in front
    of that "http://host:port"; every proxy made is stopped at the end of the test."""
    proxies: list[FaultProxy] = []

    def make(upstream: str, flavor: str = "s3") -> FaultProxy:
        parts = urlsplit(upstream)
        assert parts.hostname and parts.port, f"not an http://host:port endpoint: {upstream}"
        proxy = FaultProxy(parts.hostname, parts.port, flavor=flavor).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.stop()
