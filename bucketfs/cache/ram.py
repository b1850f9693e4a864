"""The RAM tier: blocks in memory under a hard byte budget, ranked by the eviction
policy. Eviction drops the bytes: with an SSD tier, every block fetched from the origin
was already written through to it (see `tiered.BlockCache`)."""

from __future__ import annotations

from collections.abc import Callable

from bucketfs.cache.blocks import BlockId
from bucketfs.prefetch.eviction import EvictionPolicy


class RamTier:
    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        self.capacity = capacity
        self.policy = policy
        self.blocks: dict[BlockId, bytes] = {}
        self.costs: dict[BlockId, float] = {}
        self.used = 0
        self.evictions = 0
        #: Told of each block evicted to make room (hinted prefetch counts waste by it).
        self.on_evict: Callable[[BlockId], None] | None = None

    def get(self, block: BlockId) -> bytes | None:
        data = self.blocks.get(block)
        if data is not None:
            self.policy.touch(block)
        return data

    def put(self, block: BlockId, data: bytes, cost: float) -> None:
        """Admit a block, evicting as the policy says; one larger than the budget is not
        admitted (the reader still gets its bytes)."""
        if block in self.blocks or len(data) > self.capacity:
            return
        while self.used + len(data) > self.capacity:
            victim = self.policy.victim()
            assert victim is not None, "used > 0 means the policy ranks something"
            self.remove(victim)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim)
        self.blocks[block] = data
        self.costs[block] = cost
        self.used += len(data)
        self.policy.admit(block, len(data), cost)

    def remove(self, block: BlockId) -> None:
        data = self.blocks.pop(block, None)
        if data is not None:
            del self.costs[block]
            self.used -= len(data)
            self.policy.remove(block)
