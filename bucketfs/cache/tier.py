"""What every cache tier is to the `BlockCache`: the RAM tier, the node's SSD tier, and
any tier added between them and the origin. Only `BlockCache` (tiered.py) knows there
are tiers; it decides which thread calls them (the RAM tier in the trio thread, the
others in worker threads, since their calls block on I/O).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from bucketfs.cache.blocks import BlockId


class Hit(NamedTuple):
    """A block a tier has: its bytes, its refetch cost (seconds its GET took) and, from
    a tier that reads several blocks at once (an SSD chunk read in order), the blocks
    after it that came with the same read: (block, bytes, cost)."""

    data: bytes
    cost: float
    following: Sequence[tuple[BlockId, bytes, float]] = ()


class Tier(Protocol):
    #: "ram", "ssd": how metrics and logs name it.
    name: str
    #: Its byte budget and the bytes it holds.
    capacity: int
    used: int
    evictions: int

    def get(self, block: BlockId, ahead: int = 0) -> Hit | None:
        """The block, or None; `ahead`: how many bytes of following blocks may come with
        it. A hit counts as a use for the tier's eviction order."""
        ...

    def put(self, block: BlockId, data: bytes, cost: float) -> bool:
        """Keep the block if the tier's budget and policy let it; whether it is kept."""
        ...

    def holds(self, block: BlockId) -> bool:
        """Whether the tier has the block, at no more than an index read's cost."""
        ...


class CacheEvents:
    """Things that happen in the cache that others follow (hinted prefetch follows RAM
    evictions): listeners subscribe; the tier that sees the event calls them, in the
    trio thread."""

    def __init__(self) -> None:
        self._evicted: list[Callable[[BlockId], None]] = []

    def on_evicted(self, listener: Callable[[BlockId], None]) -> None:
        """Call `listener(block)` for each block the RAM tier evicts to make room."""
        self._evicted.append(listener)

    def evicted(self, block: BlockId) -> None:
        for listener in self._evicted:
            listener(block)
