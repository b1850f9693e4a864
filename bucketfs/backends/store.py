"""The async face of a backend.

Every SDK call runs in a worker thread, except a GET from a backend with an
`async_get_range` (libcurl on the trio thread: curl_multi.py says why); one
CapacityLimiter bounds how many of either run at once (and so how many connections and
response buffers exist). Each call goes through the one retry policy.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import trio

from bucketfs.backends.base import Backend, ListPage, ObjectInfo
from bucketfs.backends.retry import RetryPolicy, call_with_retries
from bucketfs.workers import in_worker, take_slot

T = TypeVar("T")


@dataclass(slots=True)
class RequestCounts:
    """Requests sent to the origin, retries included (metrics read these)."""

    get: int = 0
    head: int = 0
    list: int = 0
    retries: int = 0
    bytes_fetched: int = 0


#: Upper bounds (seconds) of the request-latency buckets; a last bucket takes the rest.
LATENCY_BOUNDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


@dataclass(slots=True)
class LatencyHistogram:
    """How long requests of one kind took, in fixed buckets (`bucketfs.metrics` renders it).

    `counts[i]` counts requests that took at most `bounds[i]` and more than the bound
    before; the extra last count is for those slower than every bound. Only the trio
    thread observes; a scrape reads it from another thread, so `count` is the sum of a
    copy of `counts` rather than a field of its own."""

    bounds: ClassVar[tuple[float, ...]] = LATENCY_BOUNDS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


class ObjectStore:
    def __init__(
        self, backend: Backend, *, max_workers: int, retry: RetryPolicy, page_size: int = 1000
    ) -> None:
        self.backend = backend
        self.retry = retry
        self.page_size = page_size
        self.limiter = trio.CapacityLimiter(max_workers)
        #: The backend's GET on the trio thread, preferred where it has one (base.py).
        self._async_get_range = getattr(backend, "async_get_range", None)
        self.counts = RequestCounts()
        #: Time of each attempt by kind, in the worker thread: waiting for a slot excluded.
        self.latency = {kind: LatencyHistogram() for kind in ("get", "head", "list")}

    async def _run(self, what: str, kind: str, fn: Callable[[], T]) -> T:
        histogram = self.latency[kind]

        async def attempt() -> T:
            setattr(self.counts, kind, getattr(self.counts, kind) + 1)
            took: list[float] = []

            def timed() -> T:
                began = time.monotonic()
                try:
                    return fn()
                finally:
                    took.append(time.monotonic() - began)

            try:
                return await in_worker(timed, limiter=self.limiter)
            finally:
                if took:  # empty if cancelled while waiting for a slot
                    histogram.observe(took[0])

        return await call_with_retries(self.retry, what, attempt, self._count_retry)

    async def _run_async(self, what: str, fetch: Callable[[], Awaitable[T]]) -> T:
        """A GET made on the trio thread (the backend's `async_get_range`), in a slot of
        the same limiter, through the same retry policy."""
        histogram = self.latency["get"]

        async def attempt() -> T:
            self.counts.get += 1
            slot = await take_slot(self.limiter)
            began = time.monotonic()
            try:
                return await fetch()
            finally:
                histogram.observe(time.monotonic() - began)
                self.limiter.release_on_behalf_of(slot)

        return await call_with_retries(self.retry, what, attempt, self._count_retry)

    def _count_retry(self) -> None:
        self.counts.retries += 1

    async def locate(self) -> None:
        """Let the backend find where its bucket is (base.py: `locate`), if it can."""
        locate = getattr(self.backend, "locate", None)
        if locate is not None:
            await self._run(f"locating {self.backend.url}", "head", locate)

    async def check_access(self) -> None:
        await self._run(f"checking {self.backend.url}", "list", self.backend.check_access)

    async def list_pages(self, prefix: str) -> AsyncIterator[ListPage]:
        """The pages listing the objects and common prefixes directly under `prefix`, as
        the bucket sends them (one page in memory at a time; a common prefix can come
        back on several pages)."""
        token: str | None = None
        while True:
            page = await self._run(
                f"LIST {prefix!r}",
                "list",
                functools.partial(self.backend.list_page, prefix, "/", token, self.page_size),
            )
            token = page.next_token
            yield page
            if token is None:
                return

    async def head(self, key: str) -> ObjectInfo:
        return await self._run(f"HEAD {key!r}", "head", functools.partial(self.backend.head, key))

    async def get_range(self, key: str, version: str, start: int, length: int) -> bytes:
        what = f"GET {key!r} [{start}, {start + length})"
        fetch = self._async_get_range
        if fetch is not None:
            data = await self._run_async(
                what, functools.partial(fetch, key, version, start, length))
        else:
            data = await self._run(
                what, "get",
                functools.partial(self.backend.get_range, key, version, start, length))
        self.counts.bytes_fetched += len(data)
        return data
