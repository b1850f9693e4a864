"""One retry policy for every backend call: jittered exponential backoff.

Retrying lives here and nowhere else (the SDKs' own retries are switched off), so a
read fails with EIO only after this budget, and tests can count attempts exactly.
A server that says how long to wait (Retry-After on a 503 or 429) is waited for, up to
`max_delay`; that wait is one of the budget's attempts like any other.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from bucketfs.backends.base import RETRYABLE, TransientError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Full jitter: a uniform draw below an exponentially growing cap; at least what
        the server asked for, but never past `max_delay` (a server asking for minutes
        must not hold a read longer than the configured longest backoff)."""
        backoff = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
        if retry_after is None:
            return backoff
        return max(backoff, min(retry_after, self.max_delay))


async def call_with_retries(
    policy: RetryPolicy,
    what: str,
    call: Callable[[], Awaitable[T]],
    on_retry: Callable[[], None] | None = None,
) -> T:
    """Await `call()` until it succeeds, raises a non-retryable error, or the budget is spent."""
    for attempt in range(policy.attempts):
        try:
            return await call()
        except RETRYABLE as exc:
            if attempt + 1 >= policy.attempts:
                log.warning("%s failed after %d attempts: %s", what, policy.attempts, exc)
                raise
            if on_retry is not None:
                on_retry()
            asked = exc.retry_after if isinstance(exc, TransientError) else None
            log.debug("%s: %s; retrying", what, exc)
            await trio.sleep(policy.delay(attempt, asked))
    raise AssertionError("unreachable")  # the loop either returns or raises
