"""The write-through's chunks (DiskTier.put_many, ChunkStore.write_through): a batch of
small fetched blocks is one chunk file, not a file per block; what the tier holds
already stays where it is; the budget, a crash and damage are handled as for packed
chunks; packing by a hinted order still moves them; hinted eviction keeps its choice
block by block, evicting a member alone by punching it out of its chunk."""

from __future__ import annotations

from pathlib import Path

import pytest

from bucketfs.cache import chunks
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.chunk_files import DATA_START
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.hinted_victims import HintedVictims
from bucketfs.cache.schema import WRITE_THROUGH
from bucketfs.prefetch.eviction import make_policy
from bucketfs.prefetch.next_use import NextUse
from bucketfs.prefetch.scheduler import PrefetchScheduler
from tests.chunk_helpers import (
    LAYOUT_A,
    NS,
    KiB,
    MiB,
    allocated,
    as_if_crashed,
    block_files,
    cache_files,
    chunk_files,
    files,
    forget_reads,
    open_tier,
    pack,
    totals,
)
from tests.pages import resident_bytes


def batch(blocks, cost: float = 0.01):
    return [(b, d, cost) for b, d in blocks.items()]


def fresh_tier(tmp_path: Path, count: int):
    """An empty SSD tier, its directory, and `count` small files for it (also as a list
    of their blocks in order)."""
    directory = tmp_path / "cache"
    blocks = files(count)
    return directory, blocks, list(blocks), open_tier(directory)


def serves(disk, blocks) -> bool:
    """Whether the tier gives every block back exact, with its cost."""
    return all(disk.get(block)[:2] == (data, 0.01) for block, data in blocks.items())


def test_a_batch_of_small_blocks_is_one_chunk_file(tmp_path):
    directory, blocks, _, disk = fresh_tier(tmp_path, 8)
    assert disk.put_many(batch(blocks)) == 8
    assert not block_files(directory) and len(chunk_files(directory)) == 1
    size = sum(map(len, blocks.values()))
    assert totals(disk) == (size, 1, size, size)
    forget_reads(disk)
    assert serves(disk, blocks)
    assert all(disk.packed_layout(b) is None for b in blocks)  # no order laid it out
    assert disk.put_many(batch(blocks)) == 8  # all there already: nothing written
    assert len(chunk_files(directory)) == 1 and disk.used == size
    disk.close()


def test_a_lone_block_and_a_large_block_are_files_of_their_own(tmp_path):
    directory = tmp_path / "cache"
    disk = open_tier(directory)
    (lone, data), = files(1).items()
    assert disk.put_many([(lone, data, 0.01)]) == 1
    (twice, again), = files(1, seed=3).items()  # the unmount's flush: queue and RAM
    assert disk.put_many([(twice, again, 0.01), (twice, again, 0.01)]) == 1
    large = {**files(1, seed=1, size=MiB), **files(1, seed=2, size=MiB)}  # 1 MiB blocks
    assert disk.put_many(batch(large)) == 2
    assert len(block_files(directory)) == 4 and not chunk_files(directory)
    disk.close()


def test_what_the_tier_holds_stays_where_it_is(tmp_path):
    directory, blocks, ordered, disk = fresh_tier(tmp_path, 6)
    assert disk.put(ordered[0], blocks[ordered[0]], 0.01)  # a block file
    assert pack(disk, {b: blocks[b] for b in ordered[1:3]})  # packed by an order
    assert disk.put_many(batch(blocks)) == 6
    assert len(block_files(directory)) == 1 and len(chunk_files(directory)) == 2
    assert [disk.packed_layout(b) for b in ordered] == [None, LAYOUT_A, LAYOUT_A,
                                                        None, None, None]
    assert disk.used == sum(map(len, blocks.values()))  # nothing stored twice
    disk.close()


def test_a_member_stored_meanwhile_is_dead_bytes_not_a_second_record(tmp_path,
                                                                     monkeypatch):
    """A flush at unmount may store a block while the write-through's chunk holding it
    is being written: the chunk leaves that member out of its records."""
    directory, blocks, ordered, disk = fresh_tier(tmp_path, 4)
    real = chunks.write_chunk_file

    def stored_meanwhile(path, chunk, parts):
        real(path, chunk, parts)
        disk._put_files([(ordered[1], blocks[ordered[1]], 0.01)])

    monkeypatch.setattr(chunks, "write_chunk_file", stored_meanwhile)
    assert disk.put_many(batch(blocks)) == 4  # three in the chunk, one a block file
    monkeypatch.undo()
    size = sum(map(len, blocks.values()))
    # The block file counts once; the chunk's copy is dead bytes until the chunk goes.
    assert disk.chunks.live_bytes == size - len(blocks[ordered[1]])
    assert disk.used == size + len(blocks[ordered[1]])
    assert disk.packed_layout(ordered[1]) is None and len(block_files(directory)) == 1
    forget_reads(disk)
    assert serves(disk, blocks)
    disk.close()


def test_chunks_stay_small_next_to_the_budget(tmp_path):
    directory = tmp_path / "cache"
    disk = open_tier(directory, capacity=8 * MiB, policy="lru")
    written = []
    for seed in range(4):  # 4 x ~2.6 MiB into 8 MiB: chunks of at most 512 KiB
        blocks = files(24, seed)
        disk.put_many(batch(blocks))
        written.append(blocks)
        assert disk.used <= disk.capacity
    assert disk.evictions > 0 and not block_files(directory)
    assert all(path.stat().st_size <= DATA_START + 512 * KiB
               for path in chunk_files(directory))
    assert all(disk.holds(b) for b in written[-1])  # the newest are kept
    assert disk.used == disk.chunks.data_bytes
    disk.close()


@pytest.mark.parametrize("crashed", [False, True])
def test_reopen_finds_the_same_after_a_clean_close_or_a_crash(tmp_path, crashed):
    directory, blocks, _, disk = fresh_tier(tmp_path, 10)
    assert disk.put_many(batch(blocks)) == 10
    before = totals(disk)
    disk.close()
    if crashed:
        as_if_crashed(directory)
    again = open_tier(directory)
    assert totals(again) == before
    assert serves(again, blocks)
    again.close()


def test_damage_is_a_miss_never_wrong_bytes(tmp_path):
    directory, blocks, ordered, disk = fresh_tier(tmp_path, 4)
    assert disk.put_many(batch(blocks)) == 4
    (path,) = chunk_files(directory)
    raw = bytearray(path.read_bytes())
    raw[DATA_START + len(blocks[ordered[0]]) + 5] ^= 0xFF  # a bit of the second member
    path.write_bytes(bytes(raw))
    forget_reads(disk)
    assert disk.get(ordered[1]) is None and not disk.holds(ordered[1])
    assert all(disk.get(b)[:2] == (blocks[b], 0.01) for b in ordered if b != ordered[1])
    disk.close()


def test_reading_the_first_member_reads_nothing_ahead_reading_on_does(tmp_path):
    """Blocks are in the order they were fetched: a read at the start of the chunk says
    nothing of the next member (a packed chunk's first read starts a pass); a read
    that continues where the last one stopped does."""
    blocks = files(4)
    ordered = list(blocks)
    disk = open_tier(tmp_path / "cache")
    assert disk.put_many(batch(blocks)) == 4
    forget_reads(disk)
    assert disk.get(ordered[0], 10 * MiB)[2] == []
    assert [b for b, _, _ in disk.get(ordered[1], 10 * MiB)[2]] == ordered[2:]
    disk.close()


def test_packing_by_an_order_moves_members_and_frees_the_emptied_chunk(tmp_path):
    directory, blocks, _, disk = fresh_tier(tmp_path, 6)
    assert disk.put_many(batch(blocks)) == 6
    (through,) = chunk_files(directory)
    assert pack(disk, blocks)
    assert not through.exists() and len(chunk_files(directory)) == 1
    assert all(disk.packed_layout(b) == LAYOUT_A for b in blocks)
    size = sum(map(len, blocks.values()))
    assert totals(disk) == (size, 1, size, size)
    disk.close()


def test_the_write_through_tag_is_not_a_layout(tmp_path):
    disk = open_tier(tmp_path / "cache")
    with pytest.raises(ValueError):
        pack(disk, files(2), WRITE_THROUGH)
    disk.close()


def hinted_tier(directory: Path, count: int, capacity_blocks: int):
    """An SSD tier whose victims a plan chooses (as the daemon's, with hints), and the
    blocks of that plan's `count` files of 8 KiB, in its order."""
    keys = [f"img/{i:02d}.jpg" for i in range(count)]
    plans = PrefetchScheduler(window_bytes=2 * 8 * KiB, budget_bytes=10**12)
    plans.set_order("job", [(key, 8 * KiB) for key in keys])
    future = NextUse(plans)
    disk = DiskTier(directory, capacity_blocks * 8 * KiB, make_policy("cost-lrfu"),
                    source=NS, block_size=MiB,
                    hinted=HintedVictims(future.distance, future.plans))
    blocks = [BlockId(key, "v1", 0, size=8 * KiB) for key in keys]
    return disk, plans, blocks


def data_of(block: BlockId) -> bytes:
    return block.key.encode().ljust(8 * KiB, b"#")


def test_while_orders_are_hinted_members_are_evicted_one_by_one(tmp_path):
    """A write-through chunk's members were fetched together, not laid out for an
    order, so their next uses differ: hinted eviction takes the one a reader has read
    and keeps its neighbour, punching the read one's bytes out of the chunk file."""
    directory = tmp_path / "cache"
    disk, plans, blocks = hinted_tier(directory, 50, capacity_blocks=40)
    # Fetched in pairs that the order reads far apart: chunk i holds files i and 20 + i.
    fetched = [b for pair in zip(blocks[:20], blocks[20:40], strict=True) for b in pair]
    assert disk.put_many([(b, data_of(b), 0.01) for b in fetched]) == 40
    assert len(chunk_files(directory)) == 20 and not block_files(directory)  # in pairs
    assert disk.used == disk.capacity
    before = sum(map(allocated, chunk_files(directory)))
    for block in blocks[:10]:  # read: what MIN evicts first, its next use the farthest
        plans.observe_read(block.key, job="job")
    coming = blocks[40:50]  # used before anything left on the tier is used again
    assert disk.put_many([(b, data_of(b), 0.01) for b in coming]) == 10
    assert not any(disk.holds(b) for b in blocks[:10])
    assert all(disk.holds(b) for b in blocks[10:50])  # the read ones' neighbours kept
    assert disk.used == disk.capacity == disk.chunks.live_bytes
    assert sum(map(allocated, chunk_files(directory)[:20])) <= before - 10 * 4 * KiB
    forget_reads(disk)
    assert all(disk.get(b)[0] == data_of(b) for b in blocks[10:50])
    disk.close()
    as_if_crashed(directory)  # the recount finds what the tier counted
    again = open_tier(directory, capacity=40 * 8 * KiB)
    assert (again.used, again.chunks.live_bytes) == (disk.capacity, disk.capacity)
    assert all(again.get(b)[0] == data_of(b) for b in blocks[10:50])
    again.close()


def test_a_hinted_member_used_later_than_everything_stored_is_declined(tmp_path):
    directory = tmp_path / "cache"
    disk, _, blocks = hinted_tier(directory, 48, capacity_blocks=40)
    assert disk.put_many([(b, data_of(b), 0.01) for b in blocks[:40]]) == 40
    # Nothing read yet: every file stored is used before these two, so MIN keeps them.
    assert disk.put_many([(b, data_of(b), 0.01) for b in blocks[46:48]]) == 0
    assert not any(disk.holds(b) for b in blocks[46:48])
    assert all(disk.holds(b) for b in blocks[:40]) and disk.evictions == 0
    disk.close()


def test_where_holes_cannot_be_punched_hinted_blocks_are_block_files(tmp_path):
    directory = tmp_path / "cache"
    disk, _, blocks = hinted_tier(directory, 4, capacity_blocks=40)
    disk.chunks.holes.work = False  # as on a filesystem without PUNCH_HOLE
    assert disk.put_many([(b, data_of(b), 0.01) for b in blocks]) == 4
    assert len(block_files(directory)) == 4 and not chunk_files(directory)
    disk.close()


def test_the_tiers_files_leave_the_page_cache_once_written(disk_path):
    """What the write-through stores is in RAM already, and in the page cache of the
    mount's file: the tier's own file keeps no pages once durable (chunk files, and
    block files written in a batch)."""
    directory, blocks, _, disk = fresh_tier(disk_path, 8)
    (large, large_data), = files(1, seed=1, size=MiB).items()  # a block file of its own
    assert disk.put_many([*batch(blocks), (large, large_data, 0.01)]) == 9
    written = cache_files(directory)
    assert len(written) == 2  # a chunk and a block file
    assert [resident_bytes(p) for p in written] == [0, 0]
    forget_reads(disk)
    assert serves(disk, blocks) and disk.get(large)[0] == large_data
    # What proves the check can fail: reads leave pages (the chunk's: a block file from
    # 1 MiB is read past the page cache, file_reads.py).
    assert sum(resident_bytes(p) for p in written) > 0
    disk.close()
