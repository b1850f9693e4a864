"""How an object version is cut into cache entries, and how an entry is named.

An object no larger than the block size is one entry (cached whole: one GET); a larger
one is cut into fixed-size blocks, so a partial read of a 5 GB file caches only the
blocks that were read.

An entry's name says everything that shaped its bytes: the origin (scheme, endpoint
and bucket), the key, the object version (ETag / generation), the object's size and
the byte span the entry holds. A block size is a mount setting, so it is not named as
such: the span is. Two mounts with different block sizes therefore share the entries
whose spans agree (every object no larger than both block sizes) and never mistake one
entry for another; an entry that does not name the span a read needs is a miss.
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


def entry_name(source: str, block: BlockId, block_size: int) -> bytes:
    """The name of the cache entry holding `block` (cut with `block_size`) of an object
    of the origin `source`: unique across origins, versions and spans."""
    start, end = block_span(block.size, block_size, block.index)
    text = f"{source}\0{block.key}\0{block.version}\0{block.size}\0{start}\0{end - start}"
    return text.encode("utf-8", "surrogateescape")


def entry_key_prefix(source: str, key: str) -> bytes:
    """What the names of every entry of `key` (any version, any span) start with."""
    return f"{source}\0{key}\0".encode("utf-8", "surrogateescape")


def entry_block(name: bytes, source: str, block_size: int) -> BlockId | None:
    """The block of this origin that the entry `name` holds when objects are cut with
    `block_size`; None if it is another origin's, or its span is not one of this
    block size's blocks (a mount with another block size wrote it)."""
    text = name.decode("utf-8", "surrogateescape")
    prefix = source + "\0"
    if not text.startswith(prefix):
        return None
    try:
        key, version, size, start, length = text[len(prefix):].rsplit("\0", 4)
        size_, start_, length_ = int(size), int(start), int(length)
    except ValueError:
        return None
    index, offset = divmod(start_, block_size)
    if offset or block_span(size_, block_size, index) != (start_, start_ + length_):
        return None
    return BlockId(key, version, index, size=size_)


def entry_length(name: bytes) -> int | None:
    """The number of bytes the entry `name` holds, as its name says."""
    try:
        return int(name.rsplit(b"\0", 1)[1])
    except (IndexError, ValueError):
        return None
