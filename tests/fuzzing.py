"""Shared settings and checks for the property-based (hypothesis) tests of hostile input.

By default every property runs a fixed, derandomized set of examples, so CI is
repeatable and the whole set stays within about a minute. To hunt for new failures, run
with BUCKETFS_FUZZ_SCALE=N: N times the examples, from a random seed each run (a failure
prints the seed and the smallest example hypothesis found).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("BUCKETFS_FUZZ_SCALE", "1")))


def fuzz(examples: int) -> settings:
    """Settings for one property: `examples` cases (times SCALE), no per-example deadline
    (a shared 2-core machine makes timings noisy), no example database in the tree."""
    return settings(
        max_examples=examples * SCALE,
        derandomize=SCALE == 1,
        deadline=None,
        database=None,
        print_blob=True,  # a failure prints how to replay it: @reproduce_failure(...)
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def one_line(message: str) -> bool:
    """Non-empty, and no line break of any kind (str.splitlines knows them all)."""
    return bool(message) and message.splitlines() == [message]
