"""The training side of bucketfs hints: tell a mount's daemon the order in which the
job will read its files, so it can fetch ahead and evict by the future.

    from bucketfs.hints import HintSampler, send_order, send_next_order, end_job

Only the standard library is needed here; HintSampler (which needs torch) is imported
on first use, so `send_order` works in a process without torch. Installed as
`bucketfs.hints`; the protocol is in docs/HINTS.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bucketfs.hints.client import HintError, HintWarning, end_job, send_next_order, send_order

if TYPE_CHECKING:
    from bucketfs.hints.sampler import HintSampler

__all__ = ["HintError", "HintSampler", "HintWarning", "end_job", "send_next_order",
           "send_order"]


def __getattr__(name: str) -> Any:
    if name == "HintSampler":
        from bucketfs.hints.sampler import HintSampler

        return HintSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
