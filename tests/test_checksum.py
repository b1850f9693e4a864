"""The SSD tier's CRC-32 must be zlib's, value for value: entries written by earlier
versions (zlib's crc32) are verified with it after an upgrade."""

import os
import zlib

from hypothesis import given
from hypothesis import strategies as st

from bucketfs.cache.checksum import crc32


@given(st.binary(max_size=70_000))
def test_same_value_as_zlib(data: bytes) -> None:
    assert crc32(data) == zlib.crc32(data)


def test_same_value_on_a_block_and_on_views() -> None:
    block = os.urandom(4 * 1024**2 + 7)
    assert crc32(block) == zlib.crc32(block)
    view = memoryview(block)[3:1_000_003]
    assert crc32(view) == zlib.crc32(view)
