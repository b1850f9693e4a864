"""Forward scans of one key range of the cache's RocksDB index (the listings and the SSD
tier's entries). The eviction order (ranking.py) walks its own keys: it reads no values,
goes both ways and starts at its floors, on the eviction path."""

from __future__ import annotations

from collections.abc import Iterator

from rocksdict import Rdict


def prefixed(index: Rdict, prefix: bytes, start: bytes | None = None
             ) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of the keys that start with `prefix`, in order, from `start` (a key
    at or after the prefix; default: the first). Reads one entry per step (`items()`
    reads ahead in batches, which costs a scan that stops at its first key)."""
    it = index.iter()
    it.seek(start or prefix)
    while it.valid() and (key := it.key()).startswith(prefix):
        yield key, it.value()
        it.next()
