"""Hits on the SSD tier wait in memory and reach the index in batches
(bucketfs/cache/references.py): eviction, packing and the saved totals come out exactly
as when every hit was written at once, and a clean close keeps them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from bucketfs.cache.blocks import BlockId
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.references import DeferredReferences
from bucketfs.cache.schema import ENTRY, decode_block
from bucketfs.prefetch.eviction import POLICIES, make_policy

KiB, MiB = 1024, 1024**2
NS = "mem://bucket"


def open_tier(directory: Path, policy: str, limit: int, capacity: int = 3 * MiB) -> DiskTier:
    disk = DiskTier(directory, capacity, make_policy(policy), source=NS, block_size=MiB)
    disk.references = DeferredReferences(disk.index, disk.ranking, limit)
    return disk


def blocks(count: int) -> dict[BlockId, bytes]:
    rng = random.Random(11)
    return {BlockId(f"img/{i:04d}.jpg", "v1", 0, size=60 * KiB + 13 * i):
            rng.randbytes(60 * KiB + 13 * i) for i in range(count)}


def index_contents(directory: Path) -> dict[bytes, bytes]:
    index = Rdict(str(directory / "index"), Options(raw_mode=True))
    try:
        return dict(index.items())
    finally:
        index.close()


def run(directory: Path, policy: str, limit: int, seed: int, capacity: int,
        ) -> list[frozenset[BlockId]]:
    """A seeded mix of write-through batches, lone block files, packing (which moves
    entries out of block files and other chunks, hit or not) and hits; what the tier
    holds after each step."""
    rng = random.Random(seed)
    data = blocks(120)
    names = list(data)
    disk = open_tier(directory, policy, limit, capacity)
    held: list[frozenset[BlockId]] = []
    try:
        for step in range(400):
            roll = rng.random()
            if roll < 0.15:
                batch = rng.sample(names, rng.randrange(2, 12))
                disk.put_many([(b, data[b], 0.01 * (1 + i)) for i, b in enumerate(batch)])
            elif roll < 0.25:
                block = rng.choice(names)
                disk.put(block, data[block], 0.02)
            elif roll < 0.30:
                batch = rng.sample(names, rng.randrange(2, 8))
                disk.write_chunk([(b, data[b], 0.01) for b in batch], b"layout-%d" % step)
            else:
                block = rng.choice(names)
                hit = disk.get(block)
                assert hit is None or hit.data == data[block]
            held.append(frozenset(b for b in names if disk.holds(b)))
    finally:
        disk.close()
    return held


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("capacity", [3 * MiB, 64 * MiB], ids=["evicting", "roomy"])
def test_hits_written_in_batches_evict_exactly_as_hits_written_at_once(
        tmp_path, policy, capacity):
    """Evicting: the hits are written before each victim is chosen. Roomy: they wait
    while packing moves their entries (the records they would have changed go)."""
    at_once = run(tmp_path / "at-once", policy, 1, 5, capacity)
    batched = run(tmp_path / "batched", policy, 10_000, 5, capacity)
    assert at_once == batched
    assert len(set(at_once)) > 40  # what it holds changed all along
    # Every record, rank key and the saved clocks and gap totals, byte for byte.
    assert index_contents(tmp_path / "at-once") == index_contents(tmp_path / "batched")


def test_hits_wait_in_memory_until_written_or_the_tier_closes(tmp_path):
    data = blocks(3)
    disk = open_tier(tmp_path / "cache", "cost-lrfu", limit=3)
    for block, payload in data.items():
        assert disk.put(block, payload, 0.02)  # lone blocks: block files
    first = next(iter(data))
    key = ENTRY + disk._entry(first)
    before = disk.index[key]
    assert disk.get(first).data == data[first]
    assert disk.get(first).data == data[first]
    assert disk.index[key] == before and len(disk.references) == 1
    for block in list(data)[1:]:  # the third entry waiting writes them all
        assert disk.get(block).data == data[block]
    assert len(disk.references) == 0
    written = decode_block(disk.index[key])
    assert written.state != decode_block(before).state
    assert disk.get(first).data == data[first]  # waits again
    disk.close()
    reopened = index_contents(tmp_path / "cache")
    assert decode_block(reopened[key]).state != written.state  # the close wrote it
