"""How an object version is cut into blocks, the cache's unit.

An object no larger than the block size is one block (cached whole: one GET); a larger
one is cut into fixed-size blocks, so a partial read of a 5 GB file caches only the
blocks that were read. A block of one mount is named in the SSD tier's index by the
byte span it holds, not by its index (schema.py `entry_name`): two mounts with different
block sizes share the entries whose spans agree and never mistake one for another.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ObjectRef:
    key: str
    version: str
    size: int


@dataclass(frozen=True, slots=True)
class BlockId:
    """Block `index` of an object version of `size` bytes, as one mount cuts it."""

    key: str
    version: str
    index: int
    size: int = field(kw_only=True)


def block_span(size: int, block_size: int, index: int) -> tuple[int, int]:
    """[start, end) of block `index` of an object of `size` bytes."""
    start = index * block_size
    return start, min(size, start + block_size)


def blocks_covering(size: int, block_size: int, start: int, end: int) -> range:
    """Indexes of the blocks that hold bytes [start, end) (end <= size)."""
    if end <= start:
        return range(0)
    return range(start // block_size, (end - 1) // block_size + 1)
