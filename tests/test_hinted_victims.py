"""Hinted eviction on the SSD tier (bucketfs/cache/hinted_victims.py): candidates from both
ends of the index's eviction order, ranked by the plans' future; a real DiskTier over
RocksDB replaying shuffled epochs keeps what MIN keeps."""

from __future__ import annotations

import random

import pytest

from bucketfs.cache.blocks import BlockId
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.hinted_victims import HintedVictims
from bucketfs.prefetch.eviction import make_policy
from bucketfs.prefetch.next_use import NextUse
from bucketfs.prefetch.scheduler import PrefetchScheduler

SIZE = 1000


def candidates(names: list[str]) -> list[tuple[bytes, bytes]]:
    return [(b"R" + n.encode(), n.encode()) for n in names]


def chooser(futures: dict[str, tuple[bool, float] | None], **params: int) -> HintedVictims:
    return HintedVictims(lambda key: futures.get(key), **params)


def keys_of(name: bytes) -> list[str]:
    return name.decode().split("+")  # "a+b": a chunk holding a and b


def test_a_candidate_with_no_future_goes_at_once() -> None:
    victims = chooser({"a": (True, 50.0), "b": None, "z": (True, 900.0)})
    head, tail = iter(candidates(["a", "b", "c"])), iter(candidates(["z", "y"]))
    assert victims.choose(head, tail, keys_of) == (b"Rb", b"b")


def test_the_farthest_next_use_outside_the_windows_wins() -> None:
    futures = {"a": (True, 50.0), "b": (False, 900.0), "z": (True, 700.0),
               "y": (True, 800.0)}
    victims = chooser(futures)
    head, tail = iter(candidates(["a", "b"])), iter(candidates(["z", "y"]))
    # b is farther but a reader's window holds it
    assert victims.choose(head, tail, keys_of) == (b"Ry", b"y")


def test_a_chunk_is_as_near_as_its_nearest_member() -> None:
    futures = {"a": (True, 900.0), "b": (False, 3.0), "c": (True, 400.0)}
    victims = chooser(futures)
    head, tail = iter(candidates(["a+b"])), iter(candidates(["c"]))
    assert victims.choose(head, tail, keys_of) == (b"Rc", b"c")


def test_the_walk_goes_further_while_everything_is_in_a_window() -> None:
    names = [f"k{i}" for i in range(40)]
    futures: dict[str, tuple[bool, float] | None] = {n: (False, 1.0) for n in names}
    futures["k30"] = (True, 5.0)
    victims = chooser(futures, walk=2, max_walk=64)
    assert victims.choose(iter(candidates(names)), iter([]), keys_of) == (b"Rk30", b"k30")


def test_nothing_is_evicted_when_every_candidate_is_in_a_window() -> None:
    names = [f"k{i}" for i in range(40)]
    victims = chooser({n: (False, 1.0) for n in names}, walk=2, max_walk=8)
    assert victims.choose(iter(candidates(names)), iter([]), keys_of) is None
    assert victims.refused == 1
    assert chooser({}).choose(iter([]), iter([]), keys_of) is None  # nothing cached


def test_what_comes_in_is_not_kept_when_it_is_used_last() -> None:
    victims = chooser({"a": (True, 50.0), "z": (True, 70.0)})
    head, tail = iter(candidates(["a"])), iter(candidates(["z"]))
    assert victims.choose(head, tail, keys_of, (True, 90.0)) is None  # MIN's rule
    assert victims.declined == 1
    head, tail = iter(candidates(["a"])), iter(candidates(["z"]))
    assert victims.choose(head, tail, keys_of, (True, 70.0)) is None  # a tie keeps z
    head, tail = iter(candidates(["a"])), iter(candidates(["z"]))
    assert victims.choose(head, tail, keys_of, (True, 60.0)) == (b"Rz", b"z")


def test_data_for_a_window_displaces_only_data_without_a_future() -> None:
    # RAM serves the window's read; on SSD it would only push out a file still to be read
    victims = chooser({"a": (True, 50.0), "z": (True, 900.0)})
    head, tail = iter(candidates(["a"])), iter(candidates(["z"]))
    assert victims.choose(head, tail, keys_of, (False, 2.0)) is None
    head, tail = iter(candidates(["a", "b"])), iter(candidates(["z"]))
    assert victims.choose(head, tail, keys_of, (False, 2.0)) == (b"Rb", b"b")


def test_what_readers_read_is_found_along_their_plans() -> None:
    plans = PrefetchScheduler(window_bytes=2 * SIZE, budget_bytes=10**12)
    plans.set_order("job", [(key, SIZE) for key in "abcdef"])
    for key in "abc":
        plans.observe_read(key, job="job")
    future = NextUse(plans)
    victims = HintedVictims(future.distance, future.plans)
    stored = {"a": [], "b": [(b"", b"b")], "c": [(b"", b"c")]}
    assert list(victims.behind(lambda key: stored.get(key, []))) == [(b"", b"b"), (b"", b"c")]
    stored["b"] = []  # evicted: the cursor moves past it next time, and past a for good
    assert list(victims.behind(lambda key: stored.get(key, []))) == [(b"", b"c")]
    assert victims._cursors[id(plans.plans["job"])][1] == 2
    # those are what MIN evicts first: used in a later epoch, farther than d, e, f
    head, tail = iter(candidates(["d"])), iter(candidates(["f"]))
    assert victims.choose(head, tail, keys_of, None,
                          victims.behind(lambda key: stored.get(key, []))) == (b"", b"c")


def test_walk_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        HintedVictims(lambda key: None, walk=0)


# -- a real SSD tier --------------------------------------------------------------------

class Tier:
    """A DiskTier of `capacity` blocks, read like the daemon reads: the plan learns of
    the open first, then the tier is asked, and a miss is stored."""

    def __init__(self, path, capacity: int, plans: PrefetchScheduler | None,
                 batch: int = 0) -> None:
        self.disk = DiskTier(path, capacity * SIZE, make_policy("cost-lrfu"),
                             source="test", block_size=SIZE)
        self.plans = plans
        if plans is not None:
            future = NextUse(plans)
            # With batches, as the daemon does: the plans' read files are candidates too.
            self.disk.hinted = HintedVictims(future.distance, future.plans if batch else list)
        #: Misses stored `batch` at a time through the write-through's path (chunks).
        self.batch = batch
        self.waiting: list[tuple[BlockId, bytes, float]] = []

    def read(self, key: str) -> bool:
        if self.plans is not None:
            self.plans.observe_read(key)
        block = BlockId(key, "v1", 0, size=SIZE)
        if self.disk.get(block) is not None:
            return True
        # Not stored when it is used later than anything it would evict (MIN's rule)
        data = key.encode().ljust(SIZE, b".")
        if not self.batch:
            self.disk.put(block, data, 0.01)
            return False
        self.waiting.append((block, data, 0.01))
        if len(self.waiting) == self.batch:
            self.flush()
        return False

    def flush(self) -> None:
        if self.waiting:
            self.disk.put_many(self.waiting)
            self.waiting = []


def epochs(seed: int, files: int, count: int) -> list[list[str]]:
    rng = random.Random(seed)
    names = [f"img/{i:05d}.jpg" for i in range(files)]
    return [rng.sample(names, files) for _ in range(count)]


def replay(tier: Tier, orders: list[list[str]]) -> list[int]:
    hits = []
    for order in orders:
        if tier.plans is not None:  # each epoch's order arrives at its start
            tier.plans.set_order("job", [(key, SIZE) for key in order])
        hits.append(sum(tier.read(key) for key in order))
        if tier.batch:
            tier.flush()
    return hits


@pytest.mark.parametrize("seed", range(3))
def test_shuffled_epochs_keep_what_min_keeps(tmp_path, seed: int) -> None:
    # Cache = half the data. Within an epoch every file is read once, so an epoch's hits
    # are at most what the cache holds when it starts: MIN gets exactly `capacity` per
    # epoch after the first. Hinted eviction throws out what was just read (its next use
    # is in a later epoch) and keeps the unread.
    files, capacity = 400, 200
    orders = epochs(seed, files, 4)
    plans = PrefetchScheduler(window_bytes=16 * SIZE, budget_bytes=10**12)
    hinted = replay(Tier(tmp_path / "hinted", capacity, plans), orders)
    plain = replay(Tier(tmp_path / "plain", capacity, None), orders)
    assert hinted[0] == 0 and plain[0] == 0
    for got in hinted[1:]:
        assert got >= 0.95 * capacity
    assert sum(plain[1:]) < 0.9 * sum(hinted[1:])  # cost-lrfu alone: below MIN


@pytest.mark.parametrize("seed", range(3))
def test_write_through_chunks_keep_what_min_keeps(tmp_path, seed: int) -> None:
    # The same epochs stored as the daemon's write-through stores them: batches of 8
    # misses, each a chunk. The members of a chunk have different next uses, so they are
    # admitted and evicted one by one (their room punched out of the chunk), as block
    # files were.
    files, capacity = 400, 200
    orders = epochs(seed, files, 4)
    plans = PrefetchScheduler(window_bytes=16 * SIZE, budget_bytes=10**12)
    tier = Tier(tmp_path / "hinted", capacity, plans, batch=8)
    hinted = replay(tier, orders)
    assert hinted[0] == 0
    for got in hinted[1:]:
        assert got >= 0.95 * capacity
    directory = tmp_path / "hinted"
    assert not list((directory / "data").rglob("*.blk"))
    assert list((directory / "chunks").glob("*.chk"))
    assert tier.disk.used <= capacity * SIZE
    assert tier.disk.chunks.live_bytes == tier.disk.used  # every member gone is a hole
    whole = replay(Tier(tmp_path / "whole", capacity, plans), orders)  # block by block
    assert sum(hinted[1:]) >= 0.97 * sum(whole[1:])


def test_files_in_a_reader_window_are_never_evicted(tmp_path) -> None:
    # The window holds prefetched files not read yet; a stream of unhinted reads must
    # evict around them, however recent or old they are.
    plans = PrefetchScheduler(window_bytes=5 * SIZE, budget_bytes=10**12)
    order = [f"hinted/{i}" for i in range(20)]
    plans.set_order("job", [(key, SIZE) for key in order])
    window = [key for key in order if NextUse(plans).in_window(key)]
    assert len(window) == 5
    tier = Tier(tmp_path / "tier", 8, plans)
    for key in window:  # prefetched: stored, not read
        assert tier.disk.put(BlockId(key, "v1", 0, size=SIZE), b"x" * SIZE, 0.01)
    for i in range(50):
        tier.read(f"other/{i}")
    for key in window:
        assert tier.disk.holds(BlockId(key, "v1", 0, size=SIZE))


def test_packing_stored_files_into_a_chunk_evicts_nothing(tmp_path) -> None:
    # A full tier re-lays out files it already holds: their block files give their room
    # back when the chunk is indexed, so nothing else has to go (it used to evict a
    # chunk's worth of files the readers had yet to read).
    tier = DiskTier(tmp_path / "tier", 8 * SIZE, make_policy("cost-lrfu"), source="test",
                    block_size=SIZE)
    blocks = [BlockId(f"f{i}", "v1", 0, size=SIZE) for i in range(8)]
    for block in blocks:
        assert tier.put(block, block.key.encode().ljust(SIZE, b"."), 0.01)
    assert tier.write_chunk([(b, b.key.encode().ljust(SIZE, b"."), 0.01) for b in blocks[:4]],
                            b"layout01")
    assert tier.evictions == 0
    assert all(tier.holds(block) for block in blocks)
    assert tier.used == 8 * SIZE
    for block in blocks:
        assert tier.get(block)[0] == block.key.encode().ljust(SIZE, b".")
