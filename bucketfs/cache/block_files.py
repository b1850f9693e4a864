"""The SSD tier's block file format: a header naming the entry, the data's length and
its CRC32, then the data.

A small block's file is `BFSB1` + header + entry + data. A large block's (from
`LARGE`) is `BFSB2` + header + padding length + entry + padding + data: the padding
puts the data's file offset where its buffer's address is within a page, so the file is
written past the page cache straight from the GET client's buffer (direct_writes.py).
Both are read; files of the first layout written before the second existed keep
serving.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from bucketfs.cache.direct_writes import PAGE, address_of
from bucketfs.cache.durable import Direct

MAGIC = b"BFSB1\n"
PADDED = b"BFSB2\n"
_HEADER = struct.Struct("<IQI")  # entry-name length, data length, crc32
_PADDED_HEADER = struct.Struct("<IQIH")  # the same, then the padding's length
#: Blocks from this size are written past the page cache.
LARGE = 1 << 20

__all__ = ["LARGE", "MAGIC", "PADDED", "Parsed", "block_file", "parse"]


class Parsed(NamedTuple):
    name: bytes
    length: int
    crc: int
    data: memoryview


def block_file(entry: bytes, data: Any, crc: int) -> tuple[bytes, ...]:
    """A block file's parts for durable.write_many: header and data; for a large block,
    laid out to be written past the page cache (`Direct`)."""
    if len(data) < LARGE:
        return (MAGIC + _HEADER.pack(len(entry), len(data), crc) + entry, data)
    head_len = len(PADDED) + _PADDED_HEADER.size + len(entry)
    padding = (address_of(data) - head_len) % PAGE
    return Direct((PADDED + _PADDED_HEADER.pack(len(entry), len(data), crc, padding)
                   + entry + bytes(padding), data))


def parse(raw: memoryview) -> Parsed | None:
    """A block file's header and data (a view of `raw`: a slice would copy MiBs into
    fresh pages to leave out ~100 bytes); None if the header is not one of ours."""
    magic = bytes(raw[:len(MAGIC)])
    header = _HEADER if magic == MAGIC else _PADDED_HEADER if magic == PADDED else None
    if header is None or len(raw) < len(MAGIC) + header.size:
        return None
    name_len, length, crc, *padding = header.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + header.size
    name = bytes(raw[start:start + name_len])
    return Parsed(name, length, crc, raw[start + name_len + sum(padding):])
