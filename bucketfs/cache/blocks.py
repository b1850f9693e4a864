"""How an object version is cut into cache entries.

An object no larger than the block size is one entry (cached whole: one GET); a larger
one is cut into fixed-size blocks, so a partial read of a 5 GB file caches only the
blocks that were read. Every entry names the object version it belongs to (key + ETag /
generation), so bytes of two versions can never be mixed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ObjectRef:
    key: str
    version: str
    size: int


@dataclass(frozen=True, slots=True)
class BlockId:
    key: str
    version: str
    index: int

    def encode(self, namespace: str) -> bytes:
        """A byte string unique across buckets (`namespace` is the bucket URL)."""
        text = f"{namespace}\0{self.key}\0{self.version}\0{self.index}"
        return text.encode("utf-8", "surrogateescape")


def block_span(size: int, block_size: int, index: int) -> tuple[int, int]:
    """[start, end) of block `index` of an object of `size` bytes."""
    start = index * block_size
    return start, min(size, start + block_size)


def blocks_covering(size: int, block_size: int, start: int, end: int) -> range:
    """Indexes of the blocks that hold bytes [start, end) (end <= size)."""
    if end <= start:
        return range(0)
    return range(start // block_size, (end - 1) // block_size + 1)
