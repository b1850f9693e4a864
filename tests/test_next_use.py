"""Hinted eviction as pure code: next uses across plans, Belady's MIN when costs are
equal, the window protected, the fallback order without hints, the work per victim."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

import pytest

from bucketfs.prefetch.eviction import CostAwareLRFU, EvictionPolicy, make_policy
from bucketfs.prefetch.next_use import HintedPolicy, NextUse
from bucketfs.prefetch.scheduler import PrefetchScheduler

SIZE = 100
PER_BYTE = 1e-8  # the reference cost per byte
COST = SIZE * PER_BYTE


def scheduler(window_bytes: int = 10 * SIZE) -> PrefetchScheduler:
    return PrefetchScheduler(window_bytes=window_bytes, budget_bytes=10**12)


def sized(keys: Sequence[Hashable], size: int = SIZE) -> list[tuple[Hashable, int]]:
    return [(key, size) for key in keys]


def hinted(plans: PrefetchScheduler, fallback: EvictionPolicy | None = None,
           **params: float) -> HintedPolicy:
    if fallback is None:
        fallback = CostAwareLRFU(cooldown=0)
    return HintedPolicy(fallback, NextUse(plans), **params)


# -- NextUse --------------------------------------------------------------------------

def test_next_use_is_the_nearest_over_all_plans() -> None:
    plans = scheduler(window_bytes=3 * SIZE)
    plans.set_order("a", sized("xyzw"))
    plans.set_order("b", sized("wq"))
    future = NextUse(plans)
    assert future.next_use("x") == 0
    assert future.next_use("w") == 0  # 3 items away in a, 0 in b
    assert future.next_use("nothing") is None
    plans.observe_read("x", job="a")
    # read: its next read is expected in a's next epoch: 3 items left, then 4 / 2
    assert future.nearest("x") is None
    assert future.next_use("x") == 3 + 2
    assert NextUse(plans, expect_rereads=False).next_use("x") is None
    assert future.next_use("z") == 1
    found = future.nearest("w")
    assert found is not None and found[0] is plans.plans["b"] and found[1] == 0
    assert future.in_window("y") and not future.in_window("nothing")
    plans.observe_read("w", job="b")
    assert future.next_use("w") == 2 and not future.in_window("w")  # a's window is x..z


# -- Belady's MIN -----------------------------------------------------------------------

def belady_hits(trace: Sequence[int], capacity: int) -> int:
    """Brute-force MIN with equal sizes: admit, then drop the cached key whose next use
    is farthest (never used again counts as farthest), possibly the one just admitted."""
    cached: set[int] = set()
    hits = 0
    for i, key in enumerate(trace):
        if key in cached:
            hits += 1
            continue
        cached.add(key)
        if len(cached) > capacity:
            def next_use(k: int, i: int = i) -> int:
                later = [j for j in range(i + 1, len(trace)) if trace[j] == k]
                return later[0] if later else len(trace)
            cached.remove(max(cached, key=next_use))
    return hits


def replay(policy: EvictionPolicy, plans: PrefetchScheduler, trace: Sequence[int],
           capacity: int, *, evict_first: bool = False) -> int:
    """A tier of `capacity` entries. Default: admit, then evict while over capacity
    (the policy may decline the newcomer), as MIN does."""
    hits = 0
    for key in trace:
        plans.observe_read(key)
        if key in policy:
            hits += 1
            policy.touch(key)
            continue
        if evict_first:
            while len(policy) >= capacity:
                victim = policy.victim()
                assert victim is not None
                policy.remove(victim)
        policy.admit(key, SIZE, COST)
        while len(policy) > capacity:
            victim = policy.victim()
            assert victim is not None
            policy.remove(victim)
    return hits


@pytest.mark.parametrize("seed", range(6))
def test_equal_costs_give_exactly_belady(seed: int) -> None:
    rng = random.Random(seed)
    keys = 40
    if seed % 2:  # shuffled epochs, the whole run announced as one order
        trace = [k for _ in range(4) for k in rng.sample(range(keys), keys)]
    else:  # sampling with replacement, skewed
        trace = rng.choices(range(keys), weights=[1 + (k < 8) * 8 for k in range(keys)],
                            k=300)
    capacity = rng.choice((5, 10, 20))
    plans = scheduler()
    plans.set_order("job", sized(trace))
    assert replay(hinted(plans), plans, trace, capacity) == belady_hits(trace, capacity)


def test_epoch_orders_announced_one_at_a_time() -> None:
    # Each epoch's order arrives at its start; the policy cannot see past it, but it
    # keeps every item it holds until its read in this epoch, so it gets at least what
    # the cache can hold of each epoch.
    rng = random.Random(7)
    keys, capacity = 60, 30
    plans = scheduler()
    policy = hinted(plans)
    hits = 0
    for _ in range(4):
        epoch = rng.sample(range(keys), keys)
        plans.set_order("job", sized(epoch))
        before = set(k for k in range(keys) if k in policy)
        got = replay(policy, plans, epoch, capacity)
        assert got == len(before)
        hits += got
    assert hits == 3 * capacity


# -- ranks ------------------------------------------------------------------------------

def test_entries_without_a_hinted_future_go_first() -> None:
    plans = scheduler()
    plans.set_order("job", sized("abc"))
    policy = hinted(plans)
    for key in "xaybc":
        policy.admit(key, SIZE, COST)
    assert policy.hinted("a") and not policy.hinted("x")
    order = []
    while (key := policy.victim()) is not None:
        order.append(key)
        policy.remove(key)
    # x and y in the fallback's order (cost-lrfu: the newest of equal entries first),
    # then the farthest next use first
    assert order == ["y", "x", "c", "b", "a"]


def test_the_window_is_protected_whatever_the_cost() -> None:
    plans = scheduler(window_bytes=2 * SIZE)
    plans.set_order("job", sized("abcdefgh"))  # window: a, b
    policy = hinted(plans)
    policy.admit("b", SIZE, COST / 100)  # in the window, and 100x cheaper
    policy.admit("h", SIZE, COST * 100)  # far, and expensive
    assert policy.victim() == "h"
    policy.remove("h")
    assert policy.victim() == "b"  # nothing else left: the window goes too


def test_cost_per_byte_weights_the_distance() -> None:
    plans = scheduler(window_bytes=SIZE)
    plans.set_order("job", sized("abcdefghijklmnopqrstuvwxyz"))
    policy = hinted(plans)
    policy.admit("e", SIZE, COST)  # 4 away
    policy.admit("k", SIZE, 4 * COST)  # 10 away, 4x the cost per byte: counts as ~3
    assert policy.victim() == "e"
    policy.admit("z", 10 * SIZE, 10 * COST)  # 25 away, same cost per byte as e
    assert policy.victim() == "z"
    policy.remove("z")
    policy.admit("k", SIZE, 1.2 * COST)  # within the cost tolerance of the reference
    assert policy.victim() == "k"


def test_a_plan_change_files_every_entry_again() -> None:
    plans = scheduler()
    policy = hinted(plans)
    for key in "abc":
        policy.admit(key, SIZE, COST)
    assert not any(policy.hinted(key) for key in "abc")
    plans.set_order("job", sized("cab"))
    assert all(policy.hinted(key) for key in "abc")
    assert policy.victim() == "b"
    plans.set_order("job", sized("bca"))
    assert policy.victim() == "a"
    plans.end_job("job")
    assert not policy.hinted("a")


def test_readers_moving_at_different_speeds() -> None:
    plans = scheduler(window_bytes=SIZE)
    plans.set_order("fast", sized(list(range(100))))
    plans.set_order("slow", sized([*range(100, 200), 50]))
    policy = hinted(plans)
    policy.admit(50, SIZE, COST)  # 50 away in fast, 100 in slow: filed under fast
    policy.admit(150, SIZE, COST)  # 50 away in slow
    for key in range(100):
        plans.observe_read(key, job="fast")  # fast reads all of its order, 50 too
    policy.touch(50)
    # 50's next use is now slow's last item: 100 away, farther than 150
    assert policy.victim() == 50
    for key in range(100, 140):
        plans.observe_read(key, job="slow")
    assert policy.victim() == 50  # 61 away against 10


def test_a_stale_filing_is_checked_before_eviction() -> None:
    plans = scheduler(window_bytes=SIZE)
    plans.set_order("a", sized(list(range(100))))
    plans.set_order("b", sized([*range(100, 125), 80]))
    policy = hinted(plans)
    policy.admit(80, SIZE, COST)  # 80 away in a, 25 in b: filed under b
    policy.admit(90, SIZE, COST)  # 90 away in a
    assert policy.victim() == 90
    for key in range(70):
        plans.observe_read(key, job="a")
    # 80 is now 10 away in a, but its filing still says 25 (b): that is checked, and
    # 90, 20 away, goes
    assert policy.victim() == 90
    plans.observe_read(90)  # a reader skipped ahead and read it: expected next epoch
    policy.touch(90)
    assert policy.next_use.next_use(90) == 29 + 50 and policy.victim() == 90


def test_what_a_job_has_read_is_expected_in_its_next_epoch() -> None:
    plans = scheduler(window_bytes=SIZE)
    plans.set_order("a", sized(list(range(10))))  # a short epoch, nearly done
    plans.set_order("b", sized(list(range(100, 200))))
    policy = hinted(plans)
    for key in range(9):
        plans.observe_read(key, job="a")
    for key in (0, 1, 190, 120):
        policy.admit(key, SIZE, COST)
    # 0 and 1: expected 1 + 10 / 2 = 6 items away; 190 is 90 away, 120 20 away
    assert policy.victim() == 190
    policy.remove(190)
    assert policy.victim() == 120
    policy.remove(120)
    assert policy.victim() in (0, 1)
    plans.set_order("a", sized([1, 0]))  # the next epoch: 1 first
    assert policy.victim() == 0
    policy.admit(190, SIZE, COST)
    plans.end_job("a")  # a is gone: what it read has no future left
    assert not policy.hinted(0) and policy.victim() in (0, 1)


def test_expected_rereads_weigh_cost_too() -> None:
    plans = scheduler(window_bytes=SIZE)
    plans.set_order("a", sized(list(range(100))))
    policy = hinted(plans)
    for key in range(50):
        plans.observe_read(key, job="a")
    policy.admit(0, SIZE, 10 * COST)  # expected 50 + 50 = 100 away, ~10x the cost: ~13
    policy.admit(80, SIZE, COST)  # 30 away
    assert policy.victim() == 80


def test_an_entry_whose_read_never_reached_the_daemon_is_filed_again() -> None:
    plans = PrefetchScheduler(window_bytes=4 * SIZE, budget_bytes=10**9, lookahead=8)
    plans.set_order("job", sized(list(range(100))))
    policy = hinted(plans)
    policy.admit(2, SIZE, COST)  # read next, in the window: protected
    policy.admit(60, SIZE, COST)
    assert policy.victim() == 60
    for key in (0, 1, *range(3, 12)):  # 2 was served by the page cache: never seen
        plans.observe_read(key)
    # 2 was given up by the reader: it is expected next epoch (88 + 50 items away)
    assert policy.victim() == 2


def test_a_touch_before_the_read_is_observed_is_caught_up() -> None:
    plans = scheduler(window_bytes=4 * SIZE)
    plans.set_order("job", sized(list(range(100))))
    policy = hinted(plans)
    for key in (0, 50):
        policy.admit(key, SIZE, COST)
    policy.touch(0)  # the cache saw the read first: 0 is still filed at position 0
    plans.observe_read(0)
    assert policy.victim() == 0  # done: expected 99 + 50 away


# -- the fallback -------------------------------------------------------------------------

def random_ops(seed: int, steps: int, keys: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(rng.choice(("ref", "ref", "ref", "evict")), rng.randrange(keys))
            for _ in range(steps)]


def victims(policy: EvictionPolicy, ops: list[tuple[str, int]]) -> list[Hashable | None]:
    out: list[Hashable | None] = []
    for op, key in ops:
        if op == "ref":
            if key in policy:
                policy.touch(key)
            else:
                policy.admit(key, SIZE * (1 + key % 3), COST * (1 + key % 5))
        else:
            victim = policy.victim()
            out.append(victim)
            if victim is not None:
                policy.remove(victim)
    return out


@pytest.mark.parametrize("name", ["lru", "lfu", "lrfu", "cost-lrfu"])
def test_without_hints_it_is_the_fallback(name: str) -> None:
    ops = random_ops(3, 3000, 60)
    expected = victims(make_policy(name, cooldown=8), ops)
    plans = scheduler()
    plans.set_order("other", sized(["not", "cached"]))
    assert victims(hinted(plans, make_policy(name, cooldown=8)), ops) == expected


def test_history_survives_a_hinted_spell() -> None:
    # An entry keeps the references it got while hinted when it falls back.
    plans = scheduler()
    policy = hinted(plans, make_policy("lfu", cooldown=0))
    policy.admit("a", SIZE, COST)
    policy.admit("b", SIZE, COST)
    plans.set_order("job", sized(["a", "a", "a"]))
    for _ in range(3):
        plans.observe_read("a")
        policy.touch("a")
    plans.end_job("job")
    assert not policy.hinted("a")
    assert policy.victim() == "b"  # a has 4 references, b one


def test_interface_details() -> None:
    plans = scheduler()
    with pytest.raises(ValueError):
        HintedPolicy(CostAwareLRFU(), NextUse(plans), cost_tolerance=0)
    busy = CostAwareLRFU()
    busy.admit("x", 1, 0.0)
    with pytest.raises(ValueError):
        HintedPolicy(busy, NextUse(plans))
    policy = hinted(plans)
    assert policy.victim() is None
    policy.touch("unknown")
    policy.remove("unknown")
    policy.admit("a", SIZE, 0.0)
    state = policy.export("a")
    other = hinted(plans)
    other.restore_clock(policy.export_clock())
    other.restore("a", SIZE, 0.0, state)
    assert "a" in other and len(other) == 1 and other.clock == policy.clock
    assert other.export("a") == state


def test_blocks_map_to_their_file() -> None:
    plans = scheduler()
    plans.set_order("job", sized(["f", "g"]))
    policy = hinted(plans, key_of=lambda block: block[0])
    for block in (("f", 0), ("f", 1), ("g", 0), ("h", 0)):
        policy.admit(block, SIZE, COST)
    assert policy.victim() == ("h", 0)
    policy.remove(("h", 0))
    assert policy.victim() == ("g", 0)


# -- the work per victim ----------------------------------------------------------------

class CountingNextUse(NextUse):
    calls = 0

    def nearest(self, key: Hashable, plans=None) -> object:  # type: ignore[override]
        self.calls += 1
        return super().nearest(key, plans)


def test_no_scan_per_victim() -> None:
    entries = 20_000
    rng = random.Random(1)
    plans = scheduler()
    plans.set_order("a", sized(rng.sample(range(entries), entries)))
    plans.set_order("b", sized(rng.sample(range(entries), entries)))
    future = CountingNextUse(plans)
    policy = HintedPolicy(CostAwareLRFU(cooldown=0), future)
    for key in range(entries):
        policy.admit(key, SIZE, COST)
    assert future.calls == 0  # filed when a victim is first wanted, not per admission
    assert policy.hinted(0)
    filing = future.calls
    assert filing == entries
    for step in range(5000):  # readers move at different speeds; entries go and return
        plans.observe_read(plans.plans["a"].keys[step], job="a")
        if step % 3 == 0:
            plans.observe_read(plans.plans["b"].keys[step // 3], job="b")
        victim = policy.victim()
        assert victim is not None
        policy.remove(victim)
        policy.admit(victim, SIZE, COST)
    per_victim = (future.calls - filing) / 5000
    assert per_victim < 4


@pytest.mark.parametrize("name", ["lru", "lfu", "lrfu", "cost-lrfu"])
def test_with_no_plan_at_all_it_is_the_fallback_and_a_plan_later_finds_every_entry(
        name: str) -> None:
    ops = random_ops(4, 3000, 60)
    expected = victims(make_policy(name, cooldown=8), ops)
    plans = scheduler()
    policy = hinted(plans, make_policy(name, cooldown=8))
    assert victims(policy, ops) == expected
    # A plan arriving now files the entries the plain spell referenced: those it reads
    # go last, the others keep their fallback order.
    present = [key for key in range(60) if key in policy]
    plans.set_order("job", sized([present[0]]))
    assert policy.hinted(present[0]) and not policy.hinted(present[1])
    evicted = []
    while (victim := policy.victim()) is not None:
        evicted.append(victim)
        policy.remove(victim)
    assert evicted[-1] == present[0] and sorted(evicted) == present
