"""The SSD tier's eviction order kept as index keys (bucketfs/cache/ranking.py) decides
exactly as the same policy does with its heaps in memory."""

from __future__ import annotations

import math
import random

import pytest
from rocksdict import Options, Rdict, WriteBatch

from bucketfs.cache.ranking import IndexRanking
from bucketfs.cache.schema import ordered
from bucketfs.prefetch.eviction import POLICIES, make_policy


def test_ordered_bytes_sort_like_the_floats():
    rng = random.Random(3)
    values = [-math.inf, -1e300, -2.5, -1.0, 0.0, 1e-300, 1.0, 3.5, 1e300, math.inf]
    values += [rng.uniform(-1e9, 1e9) for _ in range(2000)]
    assert sorted(values) == sorted(values, key=ordered)


class Replay:
    """One IndexRanking over a real RocksDB, with the records a tier would keep."""

    def __init__(self, path, name: str) -> None:
        self.index = Rdict(str(path), Options(raw_mode=True))
        self.ranking = IndexRanking(self.index, make_policy(name))
        self.records: dict[bytes, tuple[int, float, tuple[float, ...]]] = {}

    def admit(self, key: bytes, size: int, cost: float) -> None:
        batch = WriteBatch(raw_mode=True)
        self.records[key] = (size, cost, self.ranking.admitted(batch, key, size, cost))
        self.index.write(batch)

    def touch(self, key: bytes) -> None:
        size, cost, saved = self.records[key]
        batch = WriteBatch(raw_mode=True)
        state = self.ranking.referenced_later(size, cost, saved)
        self.ranking.moved(batch, key, size, cost, saved, state)
        self.records[key] = (size, cost, state)
        self.index.write(batch)

    def remove(self, key: bytes) -> None:
        size, cost, saved = self.records.pop(key)
        batch = WriteBatch(raw_mode=True)
        self.ranking.removed(batch, key, size, cost, saved)
        self.index.write(batch)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_index_order_matches_the_policy_in_memory(tmp_path, name):
    rng = random.Random(7)
    replay = Replay(tmp_path / "index", name)
    heap = make_policy(name)
    capacity = 40
    for step in range(6000):
        key = f"k{rng.randrange(120)}".encode()
        if key in replay.records:
            replay.touch(key)
            heap.touch(key)
        else:
            while len(replay.records) >= capacity:
                victim = replay.ranking.victim()
                assert victim == heap.victim(), f"step {step}"
                replay.remove(victim)
                heap.remove(victim)
            size = rng.choice([1000, 5000, 100_000])
            cost = rng.choice([0.0, 0.001, 0.01, 0.2])
            replay.admit(key, size, cost)
            heap.admit(key, size, cost)
    # Only the rank and recency keys of live entries are left in the index.
    keys = list(replay.index.keys())  # a raw-mode Rdict cannot be iterated directly
    assert {k[:1] for k in keys} <= {b"R", b"T"}
    rank_keys = sum(1 for k in keys if k[:1] == b"R")
    assert rank_keys == len(replay.records)
    replay.index.close()


def test_cooling_entries_go_last_but_the_budget_still_wins(tmp_path):
    replay = Replay(tmp_path / "index", "lru")
    replay.admit(b"a", 1, 0.0)
    replay.admit(b"b", 1, 0.0)
    # Both cool (cooldown 64 references): the lowest rank goes anyway.
    assert replay.ranking.victim() == b"a"
    for i in range(70):
        replay.admit(f"x{i}".encode(), 1, 0.0)
    assert replay.ranking.victim() == b"a"
    replay.touch(b"a")
    assert replay.ranking.victim() == b"b"
    replay.index.close()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_scans_start_at_a_floor_no_live_key_sorts_below(tmp_path, name):
    # Scans seek to a floor instead of the prefix, to step over deleted keys (RocksDB
    # walks them one by one). A floor above a live key would hide it: check the floor
    # against every live key while entries of any cost come, go and are touched.
    rng = random.Random(11)
    replay = Replay(tmp_path / "index", name)
    for step in range(3000):
        key = f"k{rng.randrange(80)}".encode()
        if key in replay.records:
            if rng.random() < 0.2:
                replay.remove(key)  # not the victim: a deletion anywhere
            else:
                replay.touch(key)
        else:
            while len(replay.records) >= 30:
                replay.remove(replay.ranking.victim())
            replay.admit(key, rng.choice([1000, 100_000]), rng.choice([0.0, 0.001, 0.5]))
        if step % 7 == 0:  # head() scans the rank keys from the floor
            ranking = replay.ranking
            head = [entry for _, (_, entry) in zip(range(3), ranking.head(), strict=False)]
            width = 1 + ranking.rank_width
            keys = list(replay.index.keys())  # a raw-mode Rdict is not iterable
            in_order = [k[width:] for k in keys if k[:1] == b"R"]
            rest = [e for e in in_order if e != head[0] and e not in ranking.cooling]
            assert head == [head[0], *rest[:2]], f"step {step}"
        keys = list(replay.index.keys())
        for prefix, floor in replay.ranking.floors.items():
            live = [k for k in keys if k[:1] == prefix]
            assert all(k >= floor for k in live), f"step {step}: floor above a live key"
    assert replay.ranking.floors[b"R"] > b"R"  # the floor did move up
    replay.index.close()
