"""The RAM tier: blocks in memory under a hard byte budget, ranked by the eviction
policy. Eviction drops the bytes: with an SSD tier, every block fetched from the origin
was already written through to it (see `tiered.BlockCache`). Trio thread only."""

from __future__ import annotations

from collections.abc import Iterator

from bucketfs.cache.blocks import BlockId
from bucketfs.cache.tier import CacheEvents, Hit
from bucketfs.prefetch.eviction import EvictionPolicy
from bucketfs.spare_buffers import held_bytes, spare_buffers


class RamTier:
    name = "ram"

    def __init__(self, capacity: int, policy: EvictionPolicy,
                 events: CacheEvents | None = None) -> None:
        """`events`: told of each block evicted to make room."""
        self.capacity = capacity
        self.policy = policy
        self.events = events or CacheEvents()
        self._blocks: dict[BlockId, bytes] = {}
        self._costs: dict[BlockId, float] = {}
        self.used = 0
        self.evictions = 0

    def get(self, block: BlockId, ahead: int = 0) -> Hit | None:
        data = self._blocks.get(block)
        if data is None:
            return None
        self.policy.touch(block)
        return Hit(data, self._costs[block])

    def peek(self, block: BlockId) -> Hit | None:
        """The block if held, without counting it as a use."""
        data = self._blocks.get(block)
        return None if data is None else Hit(data, self._costs[block])

    def holds(self, block: BlockId) -> bool:
        return block in self._blocks

    def items(self) -> Iterator[tuple[BlockId, bytes, float]]:
        """Every block held: (block, bytes, cost), a copy (it may change meanwhile)."""
        return iter([(b, d, self._costs[b]) for b, d in self._blocks.items()])

    def put(self, block: BlockId, data: bytes, cost: float) -> bool:
        """Admit a block, evicting as the policy says; one larger than the budget is not
        admitted (the reader still gets its bytes). A block is charged the memory it
        holds (a large GET's whole buffer: spare_buffers.held_bytes)."""
        if block in self._blocks:
            return True
        size = held_bytes(data)
        if size > self.capacity:
            return False
        while self.used + size > self.capacity:
            victim = self.policy.victim()
            assert victim is not None, "used > 0 means the policy ranks something"
            self.remove(victim)
            self.evictions += 1
            self.events.evicted(victim)
        self._blocks[block] = data
        self._costs[block] = cost
        self.used += size
        self.policy.admit(block, size, cost)
        return True

    def remove(self, block: BlockId, *, offer: bool = True) -> None:
        """`offer`: give the block's buffer to the spare pool (the caller does it later
        when the buffer is still in use elsewhere)."""
        data = self._blocks.pop(block, None)
        if data is not None:
            del self._costs[block]
            self.used -= held_bytes(data)
            self.policy.remove(block)
            if offer:
                spare_buffers.offer(data)
