"""The SSD tier's CRC-32 must be zlib's, value for value: entries written by earlier
versions (zlib's crc32) are verified with it after an upgrade."""

import os
import zlib

from hypothesis import given
from hypothesis import strategies as st

from bucketfs.cache import checksum
from bucketfs.cache.checksum import crc32


@given(st.binary(max_size=70_000))
def test_same_value_as_zlib(data: bytes) -> None:
    assert crc32(data) == zlib.crc32(data)


def test_same_value_on_a_block_and_on_views() -> None:
    block = os.urandom(4 * 1024**2 + 7)
    assert crc32(block) == zlib.crc32(block)
    view = memoryview(block)[3:1_000_003]
    assert crc32(view) == zlib.crc32(view)


def test_same_value_at_every_boundary_of_the_pieces() -> None:
    data = os.urandom(300_000)
    for size in (5119, 5120, 5121, 10_240, 10_241, 100_000, 262_143, 262_144, 262_145):
        for kind in (bytes, bytearray, memoryview):
            assert crc32(kind(data[:size])) == zlib.crc32(data[:size]), (size, kind)


def test_a_block_under_256_kib_is_checksummed_in_pieces_that_keep_the_gil(monkeypatch):
    # zlib-ng releases the GIL for a buffer over 5 KiB; a worker that releases it must
    # wait to take it back from the trio thread. A small block's pieces never exceed it;
    # a large block goes whole (its CRC is long enough to let the trio thread run).
    sizes: list[int] = []

    def recording(data, value=0):
        sizes.append(len(data))
        return zlib.crc32(data, value)

    monkeypatch.setattr(checksum, "_crc32", recording)
    block = os.urandom(100_000)
    assert checksum.crc32(block) == zlib.crc32(block)
    assert len(sizes) == 20 and max(sizes) <= 5 * 1024
    sizes.clear()
    large = os.urandom(4 * 1024**2)
    assert checksum.crc32(large) == zlib.crc32(large)
    assert sizes == [len(large)]
