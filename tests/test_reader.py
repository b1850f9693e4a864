"""The read path as pure code: byte-exact reads through the block cache, read-ahead and
its memory bound, retries, and versions never mixed."""

from __future__ import annotations

import random

import pytest
import trio

from bucketfs.backends.base import TransientError, VersionChanged
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tiered import BlockCache
from bucketfs.prefetch.eviction import make_policy
from bucketfs.reader import COUNTED_BLOCKS, ByteBudget, Reader, ReadSettings
from tests.membackend import MemoryBackend

MiB = 1024**2
KiB = 1024


def blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def make_reader(backend, nursery, *, budget=64 * MiB, ram=256 * MiB, block=1 * MiB,
                readahead_max=4 * MiB):
    store = ObjectStore(backend, max_workers=4, retry=RetryPolicy(3, 0.001, 0.002))
    cache = BlockCache(store, RamTier(ram, make_policy("lru")), None,
                       block_size=block, nursery=nursery)
    return Reader(cache, ByteBudget(budget),
                  ReadSettings(readahead_initial=256 * KiB, readahead_max=readahead_max),
                  nursery)


async def read_all(reader, handle, chunk=128 * KiB):
    out = bytearray()
    offset = 0
    while data := await reader.read(handle, offset, chunk):
        out += data
        offset += len(data)
    return bytes(out)


def run(main):
    async def wrapper():
        async with trio.open_nursery() as nursery:
            await main(nursery)
            nursery.cancel_scope.cancel()

    trio.run(wrapper)


def test_sequential_read_is_exact_reads_ahead_and_gets_each_block_once():
    data = blob(10 * MiB + 12345)
    backend = MemoryBackend({"big": data})

    async def main(nursery):
        reader = make_reader(backend, nursery)
        handle = reader.open("big", backend.version("big"), len(data))
        assert await read_all(reader, handle) == data
        assert reader.prefetches > 0
        assert reader.budget.used == 0 or reader.budget.used <= reader.budget.limit

    run(main)
    # 11 blocks of 1 MiB, each fetched exactly once (read-ahead and reader share them).
    assert sorted(start for _, start, _ in backend.get_ranges) == [i * MiB for i in range(11)]


def test_small_file_is_one_whole_object_get():
    data = blob(300 * KiB)
    backend = MemoryBackend({"img.jpg": data})

    async def main(nursery):
        reader = make_reader(backend, nursery)
        handle = reader.open("img.jpg", backend.version("img.jpg"), len(data))
        assert await read_all(reader, handle, chunk=4 * KiB) == data

    run(main)
    assert backend.get_ranges == [("img.jpg", 0, 300 * KiB)]


@pytest.mark.parametrize("size", [1, 300 * KiB, 1 * MiB, 1 * MiB + 1])
def test_a_one_block_file_is_read_exactly_without_read_ahead(size):
    # A file no larger than a block keeps no read-ahead window (nothing lies beyond its
    # one block); one byte more and it does, and its second block is read ahead.
    data = blob(size, seed=size)
    backend = MemoryBackend({"f": data})
    rng = random.Random(size)

    async def main(nursery):
        reader = make_reader(backend, nursery, block=1 * MiB)
        handle = reader.open("f", backend.version("f"), size)
        assert (handle.window is None) == (size <= 1 * MiB)
        assert await reader.read(handle, 0, size) == data
        for _ in range(50):
            offset = rng.randrange(0, size + 5)
            length = rng.randrange(1, size + 10)
            assert await reader.read(handle, offset, length) == data[offset:offset + length]
        assert await reader.read(handle, size, 10) == b""
        assert reader.bytes_read >= size
        if size <= 1 * MiB:
            assert reader.prefetches == 0

    run(main)
    # One GET per block, whatever the reads: the second block of the 1 MiB + 1 file once.
    assert backend.calls["get"] == -(-size // MiB)


def test_random_reads_are_exact_and_past_eof_is_empty():
    data = blob(3 * MiB + 7)
    backend = MemoryBackend({"f": data})
    rng = random.Random(1)

    async def main(nursery):
        reader = make_reader(backend, nursery)
        handle = reader.open("f", backend.version("f"), len(data))
        for _ in range(200):
            offset = rng.randrange(0, len(data) + 10)
            length = rng.randrange(1, 300 * KiB)
            assert await reader.read(handle, offset, length) == data[offset:offset + length]
        assert await reader.read(handle, len(data), 10) == b""
        assert await reader.read(handle, len(data) + 100, 10) == b""

    run(main)


def test_concurrent_out_of_order_reads_of_one_handle():
    data = blob(6 * MiB)
    backend = MemoryBackend({"f": data})

    async def main(nursery):
        reader = make_reader(backend, nursery)
        handle = reader.open("f", backend.version("f"), len(data))
        results = {}

        async def one(offset):
            results[offset] = await reader.read(handle, offset, 128 * KiB)

        # Like the kernel's own read-ahead: a few reads in flight at once.
        for base in range(0, len(data), 512 * KiB):
            async with trio.open_nursery() as group:
                for offset in reversed(range(base, base + 512 * KiB, 128 * KiB)):
                    group.start_soon(one, offset)
        assert b"".join(results[o] for o in sorted(results)) == data

    run(main)
    assert len(backend.get_ranges) == 6  # one GET per block, despite the races


def test_read_ahead_in_flight_stays_within_its_budget():
    files = {f"f{i}": blob(4 * MiB, seed=i) for i in range(20)}
    backend = MemoryBackend(files)
    budget = 3 * MiB

    async def main(nursery):
        reader = make_reader(backend, nursery, budget=budget, ram=16 * MiB)
        handles = {k: reader.open(k, backend.version(k), len(v)) for k, v in files.items()}

        async def consume(key):
            assert await read_all(reader, handles[key]) == files[key]

        async with trio.open_nursery() as group:
            for key in files:
                group.start_soon(consume, key)
        assert 0 < reader.budget.peak <= budget
        assert reader.cache.ram.used <= 16 * MiB

    run(main)


def test_transient_failures_are_retried_and_exhaustion_raises():
    data = blob(100 * KiB)
    backend = MemoryBackend({"ok": data, "bad": data})
    backend.failures["ok"] = 2
    backend.failures["bad"] = -1

    async def main(nursery):
        reader = make_reader(backend, nursery)
        ok = reader.open("ok", backend.version("ok"), len(data))
        assert await reader.read(ok, 0, len(data)) == data
        bad = reader.open("bad", backend.version("bad"), len(data))
        with pytest.raises(TransientError):
            await reader.read(bad, 0, 10)

    run(main)
    assert sum(1 for key, _, _ in backend.get_ranges if key == "bad") == 3


def test_changed_object_is_an_error_not_a_mix():
    old = blob(2 * MiB, seed=1)
    backend = MemoryBackend({"f": old})

    async def main(nursery):
        reader = make_reader(backend, nursery, block=256 * KiB, readahead_max=512 * KiB)
        handle = reader.open("f", backend.version("f"), len(old))
        assert await reader.read(handle, 0, 128 * KiB) == old[:128 * KiB]
        backend.objects["f"] = blob(2 * MiB, seed=2)
        with pytest.raises(VersionChanged):
            await read_all(reader, handle)

    run(main)


@pytest.mark.parametrize("ram", [0, 512 * KiB])
def test_a_ram_tier_smaller_than_a_block_still_gets_each_block_once(ram):
    # Nothing can be cached: read-ahead would fetch blocks only to drop them, and the
    # kernel's several reads of one block would each fetch it again.
    data = blob(5 * MiB + 7)
    backend = MemoryBackend({"big": data, "small": data[:300 * KiB]})

    async def main(nursery):
        reader = make_reader(backend, nursery, ram=ram)
        for key in ("big", "small"):
            handle = reader.open(key, backend.version(key), len(backend.objects[key]))
            assert await read_all(reader, handle) == backend.objects[key]
        if ram == 0:
            assert reader.prefetches == 0

    run(main)
    assert backend.calls["get"] == 6 + 1  # 6 blocks of "big", "small" whole


def reader_over_ssd(backend, nursery, directory, *, ram=64 * MiB, block=MiB):
    """A reader whose cache has an SSD tier (blocks of `block` bytes) in `directory`."""
    disk = DiskTier(directory, 256 * MiB, make_policy("lru"), source="mem://bucket",
                    block_size=block)
    store = ObjectStore(backend, max_workers=4, retry=RetryPolicy(1))
    cache = BlockCache(store, RamTier(ram, make_policy("lru")), disk, block_size=block,
                       nursery=nursery)
    return Reader(cache, ByteBudget(64 * MiB), ReadSettings(readahead_max=4 * MiB), nursery)


async def read_backwards(reader, handle, size):
    """Back to front in 512 KiB reads: every read a jump, every byte read."""
    parts = []
    for start in reversed(range(0, size, MiB // 2)):
        parts.append(await reader.read(handle, start, MiB // 2))
    return b"".join(reversed(parts))


async def read_first_halves(reader, handle, data):
    """The first half of each 1 MiB block: no block's second half is read."""
    for start in range(0, len(data), MiB):
        assert await reader.read(handle, start, MiB // 2) == data[start:start + MiB // 2]


@pytest.mark.parametrize("order", ["front to back", "backwards", "first halves"])
@pytest.mark.parametrize("ssd", ["writable", "stepped aside", None])
def test_blocks_read_front_to_back_leave_ram_once_the_ssd_tier_has_them(tmp_path, ssd, order):
    # The page cache holds what a pass read, so with an SSD tier the RAM copy of a large
    # file read through is let go: a large file read once must not push the RAM tier's
    # other blocks out. Blocks not read to their last byte, or with no SSD tier, stay.
    data = blob(10 * MiB + 12345, seed=5)
    small = blob(200 * KiB, seed=6)
    backend = MemoryBackend({"big": data, "small": small})

    async def main(nursery):
        if ssd:
            reader = reader_over_ssd(backend, nursery, tmp_path / "cache")
            # Stepped aside (a full device): nothing is written, so RAM keeps it all.
            reader.cache.disk.writable = ssd == "writable"
        else:
            reader = make_reader(backend, nursery)
        cache = reader.cache
        handle = reader.open("small", backend.version("small"), len(small))
        assert await read_all(reader, handle) == small
        handle = reader.open("big", backend.version("big"), len(data))
        if order == "front to back":
            assert await read_all(reader, handle) == data
        elif order == "backwards":
            assert await read_backwards(reader, handle, len(data)) == data
        else:
            await read_first_halves(reader, handle, data)
        with trio.fail_after(5):  # everything written through (the released buffers offered)
            while cache.queued:
                await trio.sleep(0.005)
        big_held = sum(block.key == "big" for block, _, _ in cache.ram.items())
        released = cache.stats.ram_released
        if ssd != "writable":
            assert released == 0 and big_held == 11
        elif order != "first halves":
            assert released == 11 and big_held == 0
            assert cache.ram.used == len(small)
        else:  # of the 12,345-byte tail block, its first half is all of it
            assert released == 1 and big_held == 10
        assert cache.ram.holds(BlockId("small", backend.version("small"), 0, size=len(small)))
        # Whatever left RAM is still cached: a second pass makes no GET.
        gets = backend.calls["get"]
        handle = reader.open("big", backend.version("big"), len(data))
        assert await read_all(reader, handle) == data
        assert backend.calls["get"] == gets
        if ssd:
            await cache.flush()
            cache.disk.close()

    run(main)
    assert backend.calls["get"] == 11 + 1


def test_a_handle_counts_the_bytes_read_of_a_bounded_number_of_blocks(tmp_path):
    # A reader that touches many blocks and finishes none (random small reads of a
    # large file) holds a count for at most COUNTED_BLOCKS of them, the latest.
    data = blob(100 * 64 * KiB, seed=7)
    backend = MemoryBackend({"big": data})

    async def main(nursery):
        reader = reader_over_ssd(backend, nursery, tmp_path / "cache", block=64 * KiB)
        handle = reader.open("big", backend.version("big"), len(data))
        for index in range(100):
            start = index * 64 * KiB
            assert await reader.read(handle, start, 10) == data[start:start + 10]
        assert list(handle.read_of_block) == list(range(100 - COUNTED_BLOCKS, 100))
        assert set(handle.read_of_block.values()) == {10}
        await reader.cache.flush()
        reader.cache.disk.close()

    run(main)
