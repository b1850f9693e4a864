"""The daemon-side packer (packer.ChunkPacking) over a BlockCache: it lays out on the
SSD tier what readers read, in their order, and only what a later epoch would read so."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.blocks import BlockId, ObjectRef
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tiered import BlockCache
from bucketfs.packer import ChunkPacking, layout_tag
from bucketfs.prefetch.eviction import make_policy
from tests.chunk_helpers import KiB, MiB, block_files, chunk_files, open_tier
from tests.membackend import MemoryBackend


def run_cache(directory: Path, backend: MemoryBackend, body, *, ram: int = 64 * MiB):
    async def main():
        disk = open_tier(directory)
        async with trio.open_nursery() as nursery:
            store = ObjectStore(backend, max_workers=4, retry=RetryPolicy(1))
            cache = BlockCache(store, RamTier(ram, make_policy()), disk,
                               block_size=MiB, nursery=nursery)
            try:
                await body(cache)
                await cache.flush()
            finally:
                nursery.cancel_scope.cancel()
        disk.close()

    trio.run(main)


def dataset(count: int = 60) -> dict[str, bytes]:
    rng = random.Random(count)
    return {f"img/{i:04d}.jpg": rng.randbytes(100 * KiB + 31 * i) for i in range(count)}


def refs(backend: MemoryBackend) -> dict[str, ObjectRef]:
    return {k: ObjectRef(k, backend.version(k), len(d)) for k, d in backend.objects.items()}


async def epoch(cache: BlockCache, packing: ChunkPacking, order: list[str],
                objects: dict[str, ObjectRef], job=("job", 0)) -> None:
    """What the daemon does for one hinted epoch: the order, then each open and read."""
    packing.new_order(job, layout_tag((k, objects[k].size) for k in order),
                      order_bytes=sum(objects[k].size for k in order))
    for key in order:
        packing.opened(key, job)
        await cache.get(objects[key], 0)
    await settle(packing)


async def settle(packing: ChunkPacking) -> None:
    with trio.fail_after(10):
        while packing._receive.statistics().current_buffer_used \
                or packing._receive.statistics().tasks_waiting_receive == 0:
            await trio.sleep(0.01)


def test_the_packer_lays_out_what_was_read_in_read_order(tmp_path):
    """Where the SSD tier cannot punch holes (hinted files are then block files), an
    epoch with no next order known is laid out in its own order, a guess."""
    backend = MemoryBackend(dataset())
    objects = refs(backend)
    order = sorted(objects)
    random.Random(1).shuffle(order)
    directory = tmp_path / "cache"
    seen = {}

    async def body(cache):
        cache.disk.chunks.holes.work = False  # as on a filesystem without PUNCH_HOLE
        packing = ChunkPacking(cache, objects, MiB)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(packing.run)
            await epoch(cache, packing, order, objects)
            packing.end(("job", 0))  # the last, partial chunk
            await settle(packing)
            seen["chunks"] = cache.disk.chunks.count
            seen["written"] = packing.chunks_written
            nursery.cancel_scope.cancel()

    run_cache(directory, backend, body, ram=1 * MiB)  # the next epoch reads SSD
    size = sum(len(d) for d in backend.objects.values())
    assert seen["chunks"] == seen["written"] == -(-size // (4 * MiB))
    assert not block_files(directory)
    assert backend.calls["get"] == 60

    # A new daemon reads the next epoch in the same order: from chunks, one pread each.
    async def again(cache):
        for key in order:
            assert await cache.get(objects[key], 0) == backend.objects[key]
        seen["reads"] = cache.disk.chunks.reads
        seen["ahead"] = cache.stats.disk_read_ahead

    run_cache(directory, backend, again)
    assert backend.calls["get"] == 60
    assert seen["reads"] == seen["chunks"] and seen["ahead"] == 60 - seen["chunks"]


@pytest.mark.parametrize("holes", [True, False])
def test_shuffled_epochs_are_not_rewritten_and_a_repeated_order_is_laid_out_anew(tmp_path,
                                                                                 holes):
    """Packing by a guess (no next order known) is what an order repeated proves right.
    Where holes can be punched, the write-through's chunks hold a hinted epoch's files in
    the order it fetched them, and a guess packs nothing; else it lays them out."""
    backend = MemoryBackend(dataset(40))
    objects = refs(backend)
    first, second = sorted(objects), sorted(objects, reverse=True)
    directory = tmp_path / "cache"
    seen = []

    async def body(cache):
        packing = ChunkPacking(cache, objects, MiB)
        disk = cache.disk
        if not holes:
            disk.chunks.holes.work = False  # as on a filesystem without PUNCH_HOLE
        async with trio.open_nursery() as nursery:
            nursery.start_soon(packing.run)
            for order in (first, second, second, second):
                await epoch(cache, packing, order, objects)
                packing.end(("job", 0))
                await settle(packing)
                seen.append((packing.chunks_written, disk.chunks.count,
                             disk.packed_layout(BlockId(first[0], objects[first[0]].version,
                                                        0, size=objects[first[0]].size))))
            nursery.cancel_scope.cancel()

    run_cache(directory, backend, body, ram=1 * MiB)  # mostly read back from SSD
    layout_1 = layout_tag((k, objects[k].size) for k in first)
    layout_2 = layout_tag((k, objects[k].size) for k in second)
    written, count, layouts = zip(*seen, strict=True)
    # 3 repeats the order, so the log is laid out anew (the old chunks reclaimed); 4 has
    # nothing to do
    assert written[3] == written[2] > written[1]
    assert layouts[2:] == (layout_2, layout_2)
    assert count[3] == len(chunk_files(directory))
    if holes:  # 1 and 2 are guesses: the files stay in the write-through's chunks
        assert written[:2] == (0, 0) and layouts[:2] == (None, None)
    else:  # 1 packs everything; 2 (a new order, a guess) moves nothing
        assert written[1] == written[0] > 0 and layouts[:2] == (layout_1, layout_1)
        assert count[0] == count[2] == count[3]
    assert backend.calls["get"] == 40
