"""The SSD tier's checksum of every block and packed member.

CRC-32 with zlib's polynomial, so entries written by any version verify the same, but
computed by zlib-ng's SIMD code: 18 GB/s against zlib's 2.2 GB/s on this VM for blocks
not in the CPU cache, where zlib's CRC was 18% of the daemon's CPU on a cold read of a
large object (docs/BENCHMARKS.md).

The GIL stays held for a block under `_RELEASE_FROM`. zlib-ng's `crc32`, as zlib's,
releases it for any buffer over 5 KiB; a worker thread that releases it mid-block must
take it back from the trio thread, which usually holds it: a wait and a wakeup (a
context switch, crossing cores on a large node) for a CRC that takes ~6 us for a 100 KB
file. So a smaller block is checksummed in pieces of 5 KiB, each of which keeps it; a
larger one (a large object's blocks: ~0.2 ms for 4 MiB) still lets the trio thread run
meanwhile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zlib_ng.zlib_ng import crc32 as _crc32

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc from Python 3.12

__all__ = ["crc32"]

#: The largest piece zlib-ng checksums without releasing the GIL (its threshold, and
#: zlib's: it releases for more than 5 KiB).
_HELD_PIECE = 5 * 1024
#: From this size a block's CRC releases the GIL: long enough for the trio thread to
#: use it meanwhile.
_RELEASE_FROM = 256 * 1024


def crc32(data: Buffer) -> int:
    """CRC-32 of `data` (any bytes-like object), as `zlib.crc32(data)`."""
    view = memoryview(data).cast("B")
    size = len(view)
    if size <= _HELD_PIECE or size >= _RELEASE_FROM:
        return _crc32(view)
    crc = 0
    for start in range(0, size, _HELD_PIECE):
        crc = _crc32(view[start:start + _HELD_PIECE], crc)
    return crc
