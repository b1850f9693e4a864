"""How an object version is cut into blocks, the cache's unit.

An object no larger than the block size is one block (cached whole: one GET); a larger
one is cut into fixed-size blocks, so a partial read of a 5 GB file caches only the
blocks that were read. A block of one mount is named in the SSD tier's index by the
byte span it holds, not by its index (schema.py `entry_name`): two mounts with different
block sizes share the entries whose spans agree and never mistake one for another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class ObjectRef:
    key: str
    version: str
    size: int


class BlockId(NamedTuple):
    """Block `index` of an object version of `size` bytes, as one mount cuts it.

    A named tuple, not a dataclass: a block is a key of every tier's and policy's
    dicts, several lookups per read, each with an instance made for that read, and a
    tuple hashes and compares in C. A frozen dataclass's generated `__hash__` and
    `__eq__` run as Python: 6.5 against 2.4 us for one made and looked up five times
    (docs/BENCHMARKS.md, step 26). Pass `size` by name."""

    key: str
    version: str
    index: int
    size: int


def block_span(size: int, block_size: int, index: int) -> tuple[int, int]:
    """[start, end) of block `index` of an object of `size` bytes."""
    start = index * block_size
    return start, min(size, start + block_size)


def blocks_covering(size: int, block_size: int, start: int, end: int) -> range:
    """Indexes of the blocks that hold bytes [start, end) (end <= size)."""
    if end <= start:
        return range(0)
    return range(start // block_size, (end - 1) // block_size + 1)
