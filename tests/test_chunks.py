"""Chunk files on the SSD tier (bucketfs/cache/chunks.py) as code: packing moves entries
out of block files, reads are exact and checked, read-ahead follows a pass over a chunk,
whole chunks are evicted, emptied chunks reclaimed, and the index survives a crash (the
daemon-side packer that lays out what readers read: test_chunk_packing.py)."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import random
import threading

import pytest
from rocksdict import Options, Rdict

from bucketfs.cache import admin, chunk_holes
from bucketfs.cache.chunk_files import DATA_START
from bucketfs.cache.schema import (
    ENTRY,
    chunk_key,
    chunk_rank_name,
    decode_chunk,
    decode_packed,
    encode_chunk,
    with_chunk_state,
)
from tests.chunk_helpers import (
    LAYOUT_A,
    LAYOUT_B,
    NS,
    KiB,
    MiB,
    allocated,
    as_if_crashed,
    block_files,
    chunk_files,
    files,
    forget_reads,
    open_tier,
    pack,
    totals,
)


def test_packing_moves_block_files_into_one_chunk_and_reads_are_exact(tmp_path):
    directory = tmp_path / "cache"
    blocks = files(8)
    disk = open_tier(directory)
    for block, data in blocks.items():
        assert disk.put(block, data, 0.01)
    used = disk.used
    assert len(block_files(directory)) == 8
    assert pack(disk, blocks)
    assert disk.used == used == sum(map(len, blocks.values()))  # moved, not copied
    assert not block_files(directory) and len(chunk_files(directory)) == 1
    assert (disk.chunks.count, disk.chunks.live_bytes) == (1, used)
    for block, data in blocks.items():
        assert disk.get(block)[:2] == (data, 0.01)
        assert disk.packed_layout(block) == LAYOUT_A
    # A write-through that comes after the packing finds the entry stored.
    first = next(iter(blocks))
    assert disk.put(first, blocks[first], 0.01)
    assert not block_files(directory) and disk.used == used
    stats = None
    disk.close()
    stats = admin.cache_stats(directory)
    assert (stats["entries"], stats["packed_entries"], stats["bytes"]) == (8, 8, used)
    assert stats["chunk_files"] == 1 and stats["chunk_bytes"] == used + DATA_START
    assert "8 entries packed" in admin.format_stats(stats)


def test_a_pass_over_a_chunk_reads_the_members_after_it_in_the_same_pread(tmp_path):
    blocks = files(6)
    ordered = list(blocks)
    disk = open_tier(tmp_path / "cache")
    assert pack(disk, blocks)
    data, cost, following = disk.get(ordered[0], 10 * MiB)
    assert data == blocks[ordered[0]] and cost == 0.01
    assert [(b, d) for b, d, _ in following] == [(b, blocks[b]) for b in ordered[1:]]
    assert disk.chunks.reads == 1
    # A read in the middle that continues no pass reads only itself ...
    forget_reads(disk)
    assert disk.get(ordered[3], 10 * MiB)[2] == []
    # ... one that continues where the last read stopped takes the next ones, within
    # the limit given.
    limit = len(blocks[ordered[5]])
    assert [b for b, _, _ in disk.get(ordered[4], limit)[2]] == [ordered[5]]
    assert disk.get(ordered[0], 0)[2] == []
    disk.close()


def test_a_hit_re_ranks_its_chunk_and_keeps_the_member_table_byte_for_byte(tmp_path):
    """A hit rewrites only the chunk record's policy state (not a decode and re-encode
    of its members), and the chunk moves in the eviction order, once the hits waiting
    in memory are written (references.py)."""
    blocks = files(5)
    disk = open_tier(tmp_path / "cache")
    assert pack(disk, blocks)
    before = disk.index[chunk_key(0)]
    ranked_before = [name for _, name in disk.ranking.head()]
    assert ranked_before == [chunk_rank_name(0)]
    rank_keys = [k for k, _ in disk.ranking.head()]
    assert disk.get(list(blocks)[2])[0] == blocks[list(blocks)[2]]
    assert disk.index[chunk_key(0)] == before and len(disk.references) == 1  # waits
    disk.references.write()
    after = disk.index[chunk_key(0)]
    old, new = decode_chunk(before), decode_chunk(after)
    assert new.members == old.members and (new.size, new.live, new.cost) == (
        old.size, old.live, old.cost)
    assert new.state != old.state
    assert [k for k, _ in disk.ranking.head()] != rank_keys  # re-ranked, not duplicated
    assert len(list(disk.ranking.head())) == 1
    # A state of another length cannot be spliced in: the caller re-encodes.
    assert with_chunk_state(after, (*new.state, 1.0)) is None
    assert decode_chunk(with_chunk_state(after, old.state)) == old
    # A record saved with a shorter state (another policy's) is re-encoded on a hit.
    shorter = decode_chunk(after)
    shorter.state = shorter.state[:3]
    disk.index[chunk_key(0)] = encode_chunk(shorter)
    assert disk.get(list(blocks)[3])[0] == blocks[list(blocks)[3]]
    disk.references.write()
    again = decode_chunk(disk.index[chunk_key(0)])
    assert again.members == old.members and len(again.state) == len(new.state)
    disk.close()


def test_readers_of_members_a_pass_covers_share_its_pread(tmp_path, monkeypatch):
    """DataLoader workers ask for neighbouring files at once: those a read-ahead covers
    wait for its bytes (in flight or just done) instead of reading them again."""
    blocks = files(6)
    ordered = list(blocks)
    disk = open_tier(tmp_path / "cache")
    assert pack(disk, blocks)
    gate, data_reads = threading.Event(), []
    real_pread = os.pread

    def slow_pread(fd: int, size: int, offset: int) -> bytes:
        if offset >= DATA_START:  # not the header check
            data_reads.append(offset)
            gate.wait(5)
        return real_pread(fd, size, offset)

    monkeypatch.setattr(os, "pread", slow_pread)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(disk.get, ordered[0], 10 * MiB)
        while not data_reads:
            threading.Event().wait(0.01)
        second = pool.submit(disk.get, ordered[2], 10 * MiB)
        threading.Event().wait(0.1)
        gate.set()
        assert first.result()[0] == blocks[ordered[0]]
        assert second.result() == (blocks[ordered[2]], 0.01, [])
    assert disk.get(ordered[4])[:2] == (blocks[ordered[4]], 0.01)  # from the pass just done
    assert len(data_reads) == 1 and disk.chunks.reads == 1
    monkeypatch.undo()
    disk.close()


def test_damaged_chunks_are_misses_never_wrong_bytes(tmp_path):
    directory = tmp_path / "cache"
    blocks = files(4)
    ordered = list(blocks)
    disk = open_tier(directory)
    assert pack(disk, blocks)
    (path,) = chunk_files(directory)
    raw = bytearray(path.read_bytes())
    second = DATA_START + len(blocks[ordered[0]])
    raw[second + 5] ^= 0xFF  # a flipped bit in the second member
    path.write_bytes(bytes(raw))
    forget_reads(disk)
    data, _, following = disk.get(ordered[0], 10 * MiB)
    assert data == blocks[ordered[0]]
    assert [b for b, _, _ in following] == ordered[2:]  # the damaged one left out
    assert disk.get(ordered[1]) is None and not disk.holds(ordered[1])  # its record dropped
    assert disk.get(ordered[2])[:2] == (blocks[ordered[2]], 0.01)
    assert disk.chunks.live_bytes == sum(len(blocks[b]) for b in ordered if b != ordered[1])
    # A file that is not the chunk its name says: the whole chunk goes.
    raw[:6] = b"XXXXXX"
    path.write_bytes(bytes(raw))
    forget_reads(disk)
    assert disk.get(ordered[3]) is None
    assert all(not disk.holds(b) for b in ordered) and not path.exists()
    assert totals(disk) == (0, 0, 0, 0)
    disk.close()


def test_whole_chunks_are_evicted_within_the_budget(tmp_path):
    directory = tmp_path / "cache"
    disk = open_tier(directory, capacity=3 * MiB, policy="lru")
    written = []
    for seed in range(6):  # six chunks of ~0.8 MiB into 3 MiB
        blocks = files(8, seed)
        assert pack(disk, blocks)
        written.append(blocks)
        assert disk.used <= disk.capacity
    assert disk.evictions > 0
    assert len(chunk_files(directory)) == disk.chunks.count < 6
    for blocks in written:  # a chunk is kept or evicted whole
        held = [(disk.get(b) or (None, None))[:2] == (d, 0.01) for b, d in blocks.items()]
        assert all(held) or not any(held)
    assert all(disk.holds(b) for b in written[-1])
    assert disk.used == disk.chunks.data_bytes == sum(
        len(d) for blocks in written for b, d in blocks.items() if disk.holds(b))
    disk.close()


@pytest.mark.parametrize("punches", [True, False])
def test_emptied_chunks_are_reclaimed_and_a_layout_is_not_written_twice(tmp_path, punches):
    """A member that moves out leaves a hole in its old chunk (its room comes back at
    once); where the filesystem cannot punch one, it stays dead bytes until the chunk
    empties."""
    directory = tmp_path / "cache"
    blocks = files(8)
    ordered = list(blocks)
    disk = open_tier(directory)
    if not punches:
        disk.chunks.holes.work = False  # as on a filesystem without PUNCH_HOLE
    assert pack(disk, blocks, LAYOUT_A)
    assert pack(disk, blocks, LAYOUT_A)  # already laid out so: nothing to write
    assert disk.chunks.count == 1 and disk.chunks.next_id == 1
    old_chunk = chunk_files(directory)[0]
    allocated_before = allocated(old_chunk)
    # Laid out anew for another order: half now, half later.
    assert pack(disk, {b: blocks[b] for b in reversed(ordered[:4])}, LAYOUT_B)
    assert disk.chunks.count == 2 and len(chunk_files(directory)) == 2
    half = sum(len(blocks[b]) for b in ordered[4:])
    full = sum(map(len, blocks.values()))
    if punches:
        assert disk.used == full == disk.chunks.data_bytes  # the moved bytes: a hole
        assert allocated(old_chunk) <= allocated_before - (full - half) + 8 * KiB
    else:
        assert disk.used == 2 * full - half  # the old chunk still holds dead bytes
        assert allocated(old_chunk) == allocated_before
    assert disk.chunks.live_bytes == full
    # `bucketfs cache stats` says both: the files' length and the room they take.
    stats = admin.cache_stats(directory)
    assert stats["chunk_disk_bytes"] == sum(map(allocated, chunk_files(directory)))
    holes = stats["chunk_bytes"] - stats["chunk_disk_bytes"]
    assert holes >= full - half - 16 * KiB if punches else holes < 16 * KiB
    for block in ordered[4:]:  # the members left in the old chunk, around the holes
        forget_reads(disk)
        assert disk.get(block)[:2] == (blocks[block], 0.01)
    assert pack(disk, {b: blocks[b] for b in reversed(ordered[4:])}, LAYOUT_B)
    assert disk.chunks.count == 2 and len(chunk_files(directory)) == 2  # the old one gone
    assert totals(disk) == (full, 2, full, full)
    for block, data in blocks.items():
        assert disk.get(block)[:2] == (data, 0.01) and disk.packed_layout(block) == LAYOUT_B
    disk.close()


@pytest.mark.parametrize("crashed", [False, True])
def test_reopen_counts_the_same_after_a_clean_close_or_a_crash(tmp_path, crashed):
    directory = tmp_path / "cache"
    disk = open_tier(directory, capacity=4 * MiB)
    loose = files(5, seed=9)
    for block, data in loose.items():
        assert disk.put(block, data, 0.01)
    packed = files(8, seed=1)
    assert pack(disk, packed)
    assert pack(disk, dict(list(packed.items())[:3]), LAYOUT_B)  # some dead bytes
    before = totals(disk)
    disk.close()
    if crashed:
        as_if_crashed(directory)
    again = open_tier(directory, capacity=4 * MiB)
    assert totals(again) == before
    for block, data in {**loose, **packed}.items():
        assert again.get(block)[:2] == (data, 0.01)
    assert pack(again, files(3, seed=2))  # ids go on after the ones in use
    assert again.chunks.count == 3 and len(chunk_files(directory)) == 3
    again.close()


def test_another_policy_rebuilds_the_chunks_ranks_too(tmp_path):
    directory = tmp_path / "cache"
    disk = open_tier(directory, capacity=2 * MiB)
    old = files(8, seed=1)
    assert pack(disk, old)
    disk.close()
    again = open_tier(directory, capacity=2 * MiB, policy="lru")  # ranks rebuilt
    assert again.chunks.count == 1 and again.used == sum(map(len, old.values()))
    assert pack(again, files(8, seed=2)) and pack(again, files(8, seed=3))
    assert again.evictions >= 1 and again.used <= again.capacity
    assert all(not again.holds(b) for b in old)  # the oldest chunk went, whole
    again.close()


@pytest.mark.parametrize("older", [b"1", b"2", b"3"])
def test_a_cache_of_an_older_format_starts_afresh(tmp_path, older):
    # Entries of formats 1 to 3 do not say which block size cut them: none is trusted.
    directory = tmp_path / "cache"
    blocks = files(3)
    disk = open_tier(directory)
    for block, data in blocks.items():
        assert disk.put(block, data, 0.01)
    assert pack(disk, files(4, seed=1))
    disk.close()
    index = Rdict(str(directory / "index"), Options(raw_mode=True))
    index[b"C:format"] = older
    index.close()
    again = open_tier(directory)
    assert totals(again) == (0, 0, 0, 0)
    assert all(again.get(block) is None for block in blocks)
    assert not any((directory / "data").rglob("*.blk"))
    assert not (directory / "chunks").exists() or not any((directory / "chunks").iterdir())
    assert pack(again, blocks) and again.chunks.count == 1
    again.close()
    index = Rdict(str(directory / "index"), Options(raw_mode=True))
    assert index[b"C:format"] == b"5"  # an older build now refuses it
    index.close()


def test_a_format4_cache_keeps_its_blocks_and_listings_and_is_upgraded(tmp_path):
    # Format 5 differs only in its inode records (the whole entry, not where it is):
    # they are rewritten in place, and nothing cached is dropped.
    from bucketfs.cache import schema
    from bucketfs.cache.listings import ROOT_INODE, TreeIndex
    from bucketfs.cache.schema import DirEntry

    directory = tmp_path / "cache"
    blocks, packed = files(3), files(4, seed=1)
    disk = open_tier(directory)
    for block, data in blocks.items():
        assert disk.put(block, data, 0.01)
    assert pack(disk, packed)
    space = schema.tree_space(NS, "")
    tree = TreeIndex(disk.index, space)
    tree.store(ROOT_INODE, [DirEntry("x.jpg", False, "x.jpg", size=5, version="v")], 1.0)
    x = tree.child(ROOT_INODE, "x.jpg")
    disk.index[schema.tree_inode_key(space, x.inode)] = \
        ROOT_INODE.to_bytes(8, "big") + b"x.jpg"  # as format 4 wrote it
    disk.index[b"C:format"] = b"4"
    before = totals(disk)
    disk.close()
    again = open_tier(directory)
    assert totals(again) == before
    assert all(bytes(again.get(block).data) == data
               for block, data in (blocks | packed).items())
    assert TreeIndex(again.index, space).entry_of(x.inode) == x
    assert again.index[b"C:format"] == b"5"
    again.close()


def test_startup_after_a_crash_sweeps_unindexed_chunks_and_drops_lost_ones(tmp_path):
    directory = tmp_path / "cache"
    disk = open_tier(directory)
    kept, lost = files(4, seed=1), files(4, seed=2)
    assert pack(disk, kept) and pack(disk, lost)
    disk.close()
    lost_file = chunk_files(directory)[1]
    lost_file.unlink()  # its file is gone: its records must go too
    stray = directory / "chunks" / f"{99:016x}.chk"
    stray.write_bytes(b"renamed, never indexed")
    (directory / "chunks" / f"{98:016x}.chk.1f.tmp").write_bytes(b"half a chunk")
    as_if_crashed(directory)
    again = open_tier(directory)
    assert [p.name for p in chunk_files(directory)] == [chunk_files(directory)[0].name]
    assert len(os.listdir(directory / "chunks")) == 1
    assert totals(again) == (sum(map(len, kept.values())), 1, *[sum(map(len, kept.values()))] * 2)
    assert all(not again.holds(b) for b in lost) and all(again.holds(b) for b in kept)
    again.close()


def test_a_crash_before_the_index_leaves_no_trace(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    disk = open_tier(directory)
    blocks = files(4)
    for block, data in blocks.items():
        assert disk.put(block, data, 0.01)

    def crash(*args):
        raise KeyboardInterrupt  # the process dies between rename and index

    monkeypatch.setattr(disk.chunks, "_index", crash)
    with pytest.raises(KeyboardInterrupt):
        pack(disk, blocks)
    monkeypatch.undo()
    assert len(chunk_files(directory)) == 1  # renamed, unindexed
    disk.index.close()  # no clean close
    again = open_tier(directory)
    assert not chunk_files(directory) and len(block_files(directory)) == 4
    assert again.used == sum(map(len, blocks.values())) and again.chunks.count == 0
    for block, data in blocks.items():
        assert again.get(block)[:2] == (data, 0.01)
    again.close()


def test_a_crash_between_a_batch_and_its_hole_leaves_every_member_readable(
        tmp_path, monkeypatch, caplog):
    """A member that moves out of a chunk is punched out of it only once the batch that
    moved it is written: a process that dies between the two leaves no indexed member
    reading as zeros (kill -9 used to find some: a checksum miss after the remount), and
    the next open punches the hole it missed, so the record's count is the disk's."""
    directory = tmp_path / "cache"
    blocks = files(8)
    moving = dict(list(blocks.items())[:4])
    disk = open_tier(directory)
    assert pack(disk, blocks, LAYOUT_A)
    old_chunk = chunk_files(directory)[0]
    allocated_before = allocated(old_chunk)
    indexed_at_punch = []

    def die(path, spans):
        indexed_at_punch.extend(disk.packed_layout(b) for b in moving)
        raise KeyboardInterrupt  # the process dies before the hole is punched

    monkeypatch.setattr(disk.chunks.holes, "punch", die)
    with pytest.raises(KeyboardInterrupt):
        pack(disk, moving, LAYOUT_B)
    monkeypatch.undo()
    assert indexed_at_punch == [LAYOUT_B] * 4  # the batch came first
    assert allocated(old_chunk) == allocated_before  # no hole yet
    disk.index.close()  # no clean close
    again = open_tier(directory)
    full = sum(map(len, blocks.values()))
    assert totals(again) == (full, 2, full, full)
    assert allocated(old_chunk) <= allocated_before - sum(map(len, moving.values())) + 8 * KiB
    for block, data in blocks.items():
        assert again.get(block)[:2] == (data, 0.01)
    assert "checksum" not in caplog.text
    again.close()


def test_holes_a_crash_left_unpunched_count_again_where_they_cannot_be_punched(
        tmp_path, monkeypatch):
    """The same crash, then a filesystem that punches no more holes: the recovery counts
    the bytes it could not punch in their chunk and the budget again, so the budget never
    counts less than the disk holds; a member evicted alone there frees nothing."""
    directory = tmp_path / "cache"
    blocks = files(8)
    moving = dict(list(blocks.items())[:4])
    disk = open_tier(directory)
    assert pack(disk, blocks, LAYOUT_A)

    def die(path, spans):
        raise KeyboardInterrupt

    monkeypatch.setattr(disk.chunks.holes, "punch", die)
    with pytest.raises(KeyboardInterrupt):
        pack(disk, moving, LAYOUT_B)
    monkeypatch.undo()
    disk.index.close()
    monkeypatch.setattr(chunk_holes, "_punch", lambda fd, offset, length: errno.EOPNOTSUPP)
    again = open_tier(directory)
    assert not again.chunks.holes.work
    full, moved = sum(map(len, blocks.values())), sum(map(len, moving.values()))
    assert totals(again) == (full + moved, 2, full + moved, full)
    again.chunks.holes.work = True  # it says it can, and then refuses
    stays = list(blocks)[4]
    entry = again._entry(stays)
    with again.lock:
        freed = again.chunks.forget_member(entry, decode_packed(again.index[ENTRY + entry]))
    assert freed == 0 and again.used == full + moved
    again.close()
    again = open_tier(directory)  # and the totals it saved are the records' sums
    assert again.used == full + moved
    again.close()


def test_concurrent_reads_packing_and_eviction_never_return_wrong_bytes(tmp_path):
    directory = tmp_path / "cache"
    disk = open_tier(directory, capacity=3 * MiB, policy="lru")
    sets = [files(6, seed) for seed in range(8)]
    everything = {b: d for blocks in sets for b, d in blocks.items()}
    stop = threading.Event()
    wrong = []

    def reader(seed: int) -> int:
        rng, hits = random.Random(seed), 0
        while not stop.is_set():
            block = rng.choice(list(everything))
            found = disk.get(block, 2 * MiB)
            if found is None:
                continue
            hits += 1
            if found[0] != everything[block]:
                wrong.append(block)
            wrong.extend(b for b, d, _ in found[2] if d != everything[b])
        return hits

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        readers = [pool.submit(reader, i) for i in range(3)]
        rng = random.Random(5)
        try:
            for round_ in range(40):
                blocks = rng.choice(sets)
                chosen = dict(rng.sample(list(blocks.items()), 4))
                pack(disk, chosen, bytes([round_ % 3 + 1]) * 8)
                assert disk.used <= disk.capacity
        finally:
            stop.set()
        assert sum(r.result() for r in readers) > 0
    assert not wrong
    used = totals(disk)
    disk.close()
    as_if_crashed(directory)
    again = open_tier(directory, capacity=3 * MiB, policy="lru")
    assert totals(again) == used
    again.close()


def test_a_read_that_finds_a_hole_where_its_member_was_reads_it_where_it_moved(
        tmp_path, caplog):
    """A member can move (its old place punched out) between the index read and the
    pread: that read is a miss without a warning, and `DiskTier.get` reads the member
    where its record now says, never fetching it again nor dropping it."""
    directory = tmp_path / "cache"
    blocks = files(4)
    first = next(iter(blocks))
    disk = open_tier(directory)
    assert pack(disk, blocks, LAYOUT_A)
    stale = decode_packed(disk.index[ENTRY + disk._entry(first)])
    read = disk.chunks.read

    def moved_meanwhile(entry, packed, ahead):
        disk.chunks.read = read  # once
        assert pack(disk, {first: blocks[first]}, LAYOUT_B)  # punches its old place
        return read(entry, packed, ahead)

    disk.chunks.read = moved_meanwhile
    forget_reads(disk)
    assert disk.get(first)[:2] == (blocks[first], 0.01)
    assert disk.packed_layout(first) == LAYOUT_B
    assert disk.chunks.read(disk._entry(first), stale, 0) is None  # the hole: a miss
    assert "checksum" not in caplog.text
    assert disk.get(first)[:2] == (blocks[first], 0.01)  # its record left as it is
    disk.close()


def test_the_tier_probes_whether_its_filesystem_punches_holes(tmp_path, monkeypatch):
    """Where fallocate cannot punch a hole, the tier knows it from its open on, and a
    punch refused later (a filesystem that changed its mind) turns holes off too."""
    disk = open_tier(tmp_path / "here")
    assert disk.chunks.holes.work  # this machine's filesystem can
    assert not list((tmp_path / "here" / "chunks").iterdir())  # the probe's file is gone
    disk.close()
    monkeypatch.setattr(chunk_holes, "_punch", lambda fd, offset, length: errno.EOPNOTSUPP)
    refused = open_tier(tmp_path / "there")
    assert not refused.chunks.holes.work
    refused.close()
    blocks = files(4)
    disk = open_tier(tmp_path / "here")
    assert pack(disk, blocks, LAYOUT_A)
    disk.chunks.holes.work = True  # it said it could
    assert pack(disk, dict(list(blocks.items())[:2]), LAYOUT_B)
    assert not disk.chunks.holes.work  # refused: no more tries
    full = sum(map(len, blocks.values()))
    half = sum(len(d) for d in list(blocks.values())[2:])
    assert disk.used == 2 * full - half  # nothing punched: the moved bytes stay dead
    disk.close()


def test_a_chunk_whose_room_evicted_a_member_it_moves_stays_within_the_budget(tmp_path):
    """Room for a re-layout leaves out what its moving members give back; when making
    that room evicts the chunk one of them was in, that member is new after all, and the
    tier evicts again rather than end over its budget."""
    small = files(4, seed=1)
    first, *rest = list(small)
    (large, large_data), = files(1, seed=2, size=150 * KiB).items()
    capacity = sum(map(len, small.values()))
    disk = open_tier(tmp_path / "cache", capacity=capacity, policy="lru")
    assert pack(disk, {b: small[b] for b in [first, rest[0]]}, LAYOUT_A)  # the oldest
    assert pack(disk, {b: small[b] for b in rest[1:]}, LAYOUT_A)
    assert disk.used == capacity
    assert pack(disk, {first: small[first], large: large_data}, LAYOUT_B)
    assert disk.used <= disk.capacity
    assert disk.get(first)[0] == small[first] and disk.get(large)[0] == large_data
    disk.close()
