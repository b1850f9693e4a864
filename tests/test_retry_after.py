"""Retry-After: a 503 or 429 that says how long to wait is waited for, up to the policy's
`max_delay`, and each such wait still spends one attempt of the budget.

The policy is timed on trio's MockClock (exact, no real sleeping); the backends are
checked against real servers through FaultProxy's "status:NNN:SECS".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
import trio
import trio.testing

from bucketfs.backends import retry as retry_module
from bucketfs.backends.base import BackendError, TransientError, Unreachable
from bucketfs.backends.common import retry_after
from bucketfs.backends.retry import RetryPolicy, call_with_retries
from bucketfs.backends.store import ObjectStore
from tests.faultproxy import FaultProxy
from tests.test_backends import GcsHarness, S3Harness, new_harness


@pytest.mark.parametrize(
    ("header", "seconds"),
    [(None, None), ("", None), ("7", 7.0), (" 0 ", 0.0), ("soon", None), ("-3", None),
     ("1.5", None), (format_datetime(datetime(2001, 1, 1, tzinfo=UTC), usegmt=True), 0.0)],
)
def test_retry_after_header(header: str | None, seconds: float | None) -> None:
    """Delta-seconds (digits only, per RFC 9110) or an HTTP date; anything else is ignored."""
    assert retry_after(header) == seconds


def test_retry_after_date_in_the_future() -> None:
    when = datetime.now(UTC) + timedelta(seconds=30)
    seconds = retry_after(format_datetime(when, usegmt=True))
    assert seconds is not None and 25 < seconds <= 30


@pytest.mark.parametrize("attempt", range(8))
@pytest.mark.parametrize("draw", ["lowest", "highest"])
def test_delay_is_at_least_what_the_server_asked_within_max_delay(
        attempt: int, draw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The jitter pinned to either end of its range, so each delay is one exact value:
    the larger of the drawn backoff and what the server asked for, capped."""
    monkeypatch.setattr(retry_module.random, "uniform",
                        lambda low, high: low if draw == "lowest" else high)
    policy = RetryPolicy(attempts=8, base_delay=0.1, max_delay=2.0)
    backoff = 0.0 if draw == "lowest" else min(2.0, 0.1 * 2**attempt)
    assert policy.delay(attempt, 1.5) == max(1.5, backoff)
    assert policy.delay(attempt, 60.0) == 2.0  # never past max_delay
    assert policy.delay(attempt, 0.0) == backoff
    assert policy.delay(attempt) == backoff


def run_timed(policy: RetryPolicy, errors: list[BackendError]) -> tuple[object, float, int]:
    """call_with_retries over a call that raises `errors` in turn, then returns "ok":
    (result or the exception raised, seconds slept on the mock clock, calls made)."""
    calls = 0

    async def call() -> str:
        nonlocal calls
        calls += 1
        if calls <= len(errors):
            raise errors[calls - 1]
        return "ok"

    async def main() -> tuple[object, float]:
        began = trio.current_time()
        try:
            result: object = await call_with_retries(policy, "test", call)
        except BackendError as exc:
            result = exc
        return result, trio.current_time() - began

    result, slept = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return result, slept, calls


def test_the_wait_honours_retry_after() -> None:
    # Backoff alone would wait below 0.001 + 0.002 s.
    policy = RetryPolicy(attempts=6, base_delay=0.001, max_delay=5.0)
    errors: list[BackendError] = [
        TransientError("slow down", retry_after=3.0), TransientError("slow down", retry_after=1.0),
    ]
    result, slept, calls = run_timed(policy, errors)
    assert (result, calls) == ("ok", 3)
    assert 4.0 <= slept < 4.0 + 0.003


def test_retry_after_is_capped_by_max_delay_and_spends_the_budget() -> None:
    policy = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.5)
    errors: list[BackendError] = [TransientError("busy", retry_after=3600.0)] * 5
    result, slept, calls = run_timed(policy, errors)
    assert result is errors[0] and calls == 3  # three attempts, no more
    assert slept == pytest.approx(2 * 0.5)  # two waits, each capped


def test_errors_without_retry_after_keep_the_plain_backoff() -> None:
    policy = RetryPolicy(attempts=4, base_delay=0.01, max_delay=5.0)
    errors: list[BackendError] = [TransientError("reset"), Unreachable("refused"),
                                  TransientError("503", retry_after=None)]
    result, slept, calls = run_timed(policy, errors)
    assert (result, calls) == ("ok", 4)
    assert slept < 0.01 + 0.02 + 0.04


# --- The backends read the header from real responses ----------------------------------


@pytest.fixture(scope="module", params=["s3", "gcs"])
def remote(request: pytest.FixtureRequest) -> Any:
    harness = new_harness(request, request.param)
    assert isinstance(harness, S3Harness | GcsHarness)
    harness.put("obj", b"retry after me\n")
    yield harness
    harness.close()


@pytest.fixture
def proxied(remote: S3Harness | GcsHarness, fault_proxy: Callable[..., FaultProxy]) -> Any:
    proxy = fault_proxy(remote.server.endpoint, flavor=remote.kind)
    return remote, proxy, remote.backend(endpoint_url=proxy.endpoint)


@pytest.mark.parametrize(("action", "seconds"),
                         [("status:503:2", 2.0), ("status:429:7", 7.0), ("status:503", None)])
@pytest.mark.parametrize("op", ["get", "daemon-get", "head", "list"])
def test_backends_report_retry_after(proxied: Any, op: str, action: str,
                                     seconds: float | None) -> None:
    """HEADs and LISTs go through the SDKs, which show the response's headers, and the
    daemon's GETs through libcurl, which shows them too; the blocking GET goes through
    obstore, whose errors carry none (fastget.py): still transient, retried with the
    policy's own backoff."""
    harness, proxy, backend = proxied
    if op == "get":
        seconds = None
    version = backend.head("obj").version
    proxy.add_rule(action=action, times=1)
    calls = {
        "get": lambda: backend.get_range("obj", version, 0, 5),
        "daemon-get": lambda: trio.run(backend.async_get_range, "obj", version, 0, 5),
        "head": lambda: backend.head("obj"),
        "list": lambda: backend.list_page("", None, None, 10),
    }
    with pytest.raises(TransientError) as caught:
        calls[op]()
    assert caught.value.retry_after == seconds
    assert harness.bucket in str(caught.value)
    calls[op]()  # the rule is spent: the next attempt goes through


def test_store_waits_as_asked_then_reads(proxied: Any) -> None:
    """End to end on a real server: one 503 with Retry-After: 1 to a HEAD, then the
    answer; the same for a GET (the daemon's, through libcurl)."""
    harness, proxy, backend = proxied
    version = backend.head("obj").version
    # A HEAD is a HEAD on S3, and a GET of the object's metadata on GCS's JSON API.
    if harness.kind == "gcs":
        proxy.add_rule(method="GET", path_contains="/o/obj", action="status:503:1", times=1)
    else:
        proxy.add_rule(method="HEAD", action="status:503:1", times=1)
    store = ObjectStore(backend, max_workers=1, retry=RetryPolicy(3, 0.001, 5.0))
    began = time.monotonic()
    assert trio.run(store.head, "obj").version == version
    assert time.monotonic() - began >= 1.0  # jittered backoff alone is under 2 ms
    assert (store.counts.head, store.counts.retries) == (2, 1)
    proxy.add_rule(method="GET", path_contains=harness.path_of("obj"), action="status:503:1",
                   times=1)
    began = time.monotonic()
    assert trio.run(store.get_range, "obj", version, 0, 5) == b"retry"
    assert time.monotonic() - began >= 1.0
    assert (store.counts.get, store.counts.retries) == (2, 2)
