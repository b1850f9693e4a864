"""One retry policy for every backend call: jittered exponential backoff.

Retrying lives here and nowhere else (the SDKs' own retries are switched off), so a
read fails with EIO only after this budget, and tests can count attempts exactly.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from bucketfs.backends.base import RETRYABLE

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        """Full jitter: a uniform draw below an exponentially growing cap."""
        return random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))


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
            log.debug("%s: %s; retrying", what, exc)
            await trio.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")  # the loop either returns or raises
