"""The eviction policies as pure code: orders on small hand-computed sequences, a
brute-force reference model, persistence, and the shape of the work per operation."""

from __future__ import annotations

import math
import random
from collections.abc import Hashable

import pytest

from bucketfs.prefetch import eviction
from bucketfs.prefetch.eviction import (
    LFU,
    LRFU,
    LRU,
    POLICIES,
    CostAwareLRFU,
    EvictionPolicy,
    make_policy,
)


def drain(policy: EvictionPolicy) -> list[Hashable]:
    """Every victim in turn, removing each."""
    order = []
    while (key := policy.victim()) is not None:
        order.append(key)
        policy.remove(key)
    return order


def admit_all(policy: EvictionPolicy, keys: str, size: int = 100, cost: float = 1.0) -> None:
    for key in keys:
        policy.admit(key, size, cost)


# -- orders on hand-computed sequences -------------------------------------------------

def test_lru_evicts_least_recently_referenced() -> None:
    policy = LRU(cooldown=0)
    admit_all(policy, "abc")
    policy.touch("a")
    assert drain(policy) == ["b", "c", "a"]


def test_lfu_evicts_fewest_references_then_least_recent() -> None:
    policy = LFU(cooldown=0)
    admit_all(policy, "abcd")
    for key in "aacc":
        policy.touch(key)
    policy.touch("d")
    # counts: a 3, b 1, c 3, d 2; a and c tie, a was referenced less recently
    assert drain(policy) == ["b", "d", "a", "c"]


def test_lrfu_crf_by_hand() -> None:
    # a is referenced at t=1 and t=2, b at t=3. With p=2:
    #   lam=0.5: CRF(a) at t=3 = 2^-1 + 2^-0.5 = 1.207 > CRF(b) = 1 -> b goes (frequency)
    #   lam=2:   CRF(a) at t=3 = 2^-4 + 2^-2  = 0.3125 < 1          -> a goes (recency)
    for lam, first in ((0.5, "b"), (2.0, "a")):
        policy = LRFU(p=2, lam=lam, cooldown=0)
        policy.admit("a", 1, 0.0)
        policy.touch("a")
        policy.admit("b", 1, 0.0)
        assert policy.victim() == first
        # admitted, last reference, CRF as of the last reference (1 + 2^-lam), the gap
        # between the last two references (1 + misses in between), the miss clock then
        assert policy.export("a") == pytest.approx((1.0, 2.0, 1 + 2**-lam, 1.0, 1.0))
        assert policy.clock == 3


def random_references(seed: int, steps: int, keys: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(rng.choice(("ref", "ref", "ref", "evict")), rng.randrange(keys))
            for _ in range(steps)]


def replay(policy: EvictionPolicy, ops: list[tuple[str, int]]) -> list[Hashable | None]:
    """Apply the ops (a reference admits or touches; "evict" removes the victim) and
    record the victim after each."""
    victims = []
    for op, key in ops:
        if op == "evict":
            victim = policy.victim()
            if victim is not None:
                policy.remove(victim)
        elif key in policy:
            policy.touch(key)
        else:
            policy.admit(key, 100 + key, 0.01 * (1 + key % 3))
        victims.append(policy.victim())
    return victims


def test_lrfu_with_lam_zero_is_lfu() -> None:
    ops = random_references(1, 3000, 40)
    assert replay(LRFU(lam=0, cooldown=0), ops) == replay(LFU(cooldown=0), ops)


def test_lrfu_with_large_lam_is_lru() -> None:
    # lam * log2(p) >= 1: the newest reference outweighs all older ones together.
    ops = random_references(2, 3000, 40)
    assert replay(LRFU(p=2, lam=1, cooldown=0), ops) == replay(LRU(cooldown=0), ops)
    assert replay(LRFU(p=2, lam=8, cooldown=0), ops) == replay(LRU(cooldown=0), ops)


# -- cost-aware LRFU ---------------------------------------------------------------------

def test_cost_breaks_a_crf_tie() -> None:
    policy = CostAwareLRFU(lam=0, cooldown=0)
    policy.admit("far", 100, 5.0)
    policy.admit("near", 100, 1.0)
    assert policy.victim() == "near"


def test_lower_crf_goes_first_whatever_the_cost() -> None:
    policy = CostAwareLRFU(lam=0, cooldown=0, tolerance=1)  # buckets of ratio 2
    policy.admit("cheap", 100, 1.0)
    policy.touch("cheap")  # CRF 2
    policy.admit("dear", 100, 50.0)  # CRF 1
    assert policy.victim() == "dear"


def test_crfs_within_tolerance_tie() -> None:
    # CRF 2 and CRF 1: the same bucket of ratio 3, different buckets of ratio 1.5.
    for tolerance, first in ((2.0, "cheap"), (0.5, "once")):
        policy = CostAwareLRFU(lam=0, cooldown=0, tolerance=tolerance)
        policy.admit("cheap", 100, 1.0)
        policy.touch("cheap")
        policy.admit("once", 100, 9.0)
        assert policy.victim() == first, tolerance


def test_zero_tolerance_is_the_papers_exact_rule() -> None:
    # With decay, the first entry's single reference is older: its CRF is strictly
    # lower, so cost does not enter; without decay the two CRFs are exactly equal.
    decaying = CostAwareLRFU(lam=0.01, cooldown=0, tolerance=0)
    flat = CostAwareLRFU(lam=0, cooldown=0, tolerance=0)
    for policy in (decaying, flat):
        policy.admit("old-dear", 100, 9.0)
        policy.admit("new-cheap", 100, 1.0)
    assert decaying.victim() == "old-dear"
    assert flat.victim() == "new-cheap"


def test_cost_is_compared_per_byte() -> None:
    policy = CostAwareLRFU(lam=0, cooldown=0)
    policy.admit("big", 10_000, 2.0)  # 0.0002 s/B
    policy.admit("small", 100, 1.0)  # 0.01 s/B
    assert policy.victim() == "big"


def test_costs_within_cost_tolerance_are_equal_then_most_recent_goes() -> None:
    policy = CostAwareLRFU(lam=0, cooldown=0, cost_tolerance=1.0)  # ratio-2 buckets
    policy.admit("a", 100, 1.1)
    policy.admit("b", 100, 1.0)  # 10% cheaper: measurement noise, a tie
    policy.admit("c", 100, 1.05)
    assert drain(policy) == ["c", "b", "a"]


def test_unknown_cost_ranks_cheapest() -> None:
    policy = CostAwareLRFU(lam=0, cooldown=0)
    policy.admit("known", 100, 0.5)
    policy.admit("unknown", 100, 0.0)
    policy.admit("known2", 100, 0.5)
    assert policy.victim() == "unknown"


# -- cool-down ---------------------------------------------------------------------------

def test_cooldown_protects_new_entries() -> None:
    policy = LFU(cooldown=2)
    policy.admit("a", 1, 0.0)  # t=1
    policy.touch("a")
    policy.touch("a")  # a: 3 references
    policy.admit("b", 1, 0.0)  # t=4, b: 1 reference but cooling until t=6
    assert policy.victim() == "a"
    policy.touch("a")  # t=5
    assert policy.victim() == "a"
    policy.touch("a")  # t=6: b was admitted 2 references ago
    assert policy.victim() == "b"


def test_when_everything_cools_the_lowest_goes_anyway() -> None:
    # The tier must keep to its budget: a cooling entry goes when nothing else can.
    for name, first in (("lru", "a"), ("lfu", "b"), ("lrfu", "b"), ("cost-lrfu", "b")):
        policy = make_policy(name, cooldown=100)
        policy.admit("a", 100, 1.0)
        policy.touch("a")
        policy.admit("b", 100, 1.0)
        assert policy.victim() == first, name


def test_readmitting_restarts_the_cooldown() -> None:
    policy = LRU(cooldown=2)
    admit_all(policy, "ab")
    policy.touch("b")  # t=3: a is out of its cool-down
    assert policy.victim() == "a"
    policy.admit("a", 1, 0.0)  # new bytes for a: a reference, and cooling again
    assert policy.victim() == "b"
    assert len(policy) == 2


# -- abandoned entries (cost-lrfu) -------------------------------------------------------

def test_entries_nobody_reads_go_first_whatever_their_crf() -> None:
    def run(stale_after: float) -> Hashable | None:
        policy = CostAwareLRFU(lam=0, cooldown=0, stale_after=stale_after)
        policy.admit("old", 100, 1.0)  # miss 1
        for _ in range(3):
            policy.touch("old")  # 4 references, no miss between: gaps of 1
        policy.admit("x", 100, 1.0)  # miss 2
        policy.touch("x")  # mean gap 1
        policy.admit("y", 100, 1.0)
        policy.admit("z", 100, 1.0)
        policy.admit("w", 100, 1.0)  # miss 5: "old" unread for 4 misses > 3 mean gaps
        return policy.victim()

    assert run(3.0) == "old"
    assert run(0.0) == "w"  # off: the lowest CRF, most recent first
    assert run(5.0) == "w"


def test_hits_do_not_age_entries_misses_do() -> None:
    # Staleness is counted in misses: a tier that keeps hitting does not abandon what it
    # holds, however many references go by.
    policy = CostAwareLRFU(lam=0, cooldown=0)
    for key in ("a", "b"):
        policy.admit(key, 100, 1.0)
        policy.touch(key)  # gaps of 1
    policy.admit("c", 100, 1.0)
    for _ in range(100):
        policy.touch("c")
    # 100 references later "a" is still only two misses old: the CRF order decides
    # (lowest count, most recent first), not staleness.
    assert policy.victim() == "b"
    for key in ("d", "e", "f", "g"):
        policy.admit(key, 100, 1.0)
    assert policy.victim() == "a"  # 4 misses later it is abandoned


def test_gaps_survive_a_restart() -> None:
    policy = CostAwareLRFU(lam=0, cooldown=0)
    policy.admit("old", 100, 1.0)
    policy.touch("old")
    policy.admit("x", 100, 1.0)
    policy.touch("x")
    clone = CostAwareLRFU(lam=0, cooldown=0)
    for key in ("x", "old"):
        clone.restore(key, 100, 1.0, policy.export(key))
    clone.restore_clock(policy.export_clock())
    for p in (policy, clone):
        p.admit("y", 100, 1.0)
        p.admit("z", 100, 1.0)
        p.admit("w", 100, 1.0)
    assert clone.victim() == policy.victim() == "old"
    # a state saved before gaps were kept (three numbers) still restores
    clone.restore("v", 100, 1.0, (1.0, 1.0, 1.0))
    assert clone.export("v") == (1.0, 1.0, 1.0, 0.0, 0.0)


# -- against a brute-force reference model -------------------------------------------

class Reference:
    """Keeps every reference time and ranks from scratch, straight from the definitions."""

    def __init__(self, name: str, p: float, lam: float, cooldown: int) -> None:
        self.name, self.p, self.lam, self.cooldown = name, p, lam, cooldown
        self.clock = 0
        self.misses = 0
        self.refs: dict[int, list[int]] = {}
        self.miss_at: dict[int, list[int]] = {}  # the miss clock at each reference
        self.admitted: dict[int, int] = {}
        self.costs: dict[int, float] = {}

    def reference(self, key: int, admit: bool) -> None:
        self.clock += 1
        self.misses += admit
        self.refs.setdefault(key, []).append(self.clock)
        self.miss_at.setdefault(key, []).append(self.misses)
        if admit:
            self.admitted[key] = self.clock

    def remove(self, key: int) -> None:
        self.refs.pop(key, None)
        self.miss_at.pop(key, None)
        self.admitted.pop(key, None)

    def crf(self, key: int) -> float:
        return sum(self.p ** (-self.lam * (self.clock - t)) for t in self.refs[key])

    def score(self, key: int) -> float | tuple[float, ...]:
        if self.name == "lru":
            return self.refs[key][-1]
        if self.name == "lfu":
            return len(self.refs[key]) + self.refs[key][-1] / (self.clock + 1)
        if self.name == "lrfu":
            return self.crf(key)
        # cost-lrfu with lam=0 and the default tolerances: log2 buckets of the count,
        # log-1.5 buckets of the cost per byte (sizes are 1), then most recent first.
        return (math.floor(math.log(len(self.refs[key])) / math.log(2)),
                math.floor(math.log(self.costs[key]) / math.log(1.5)), -self.refs[key][-1])

    def candidates(self) -> list[int]:
        ready = [k for k, t in self.admitted.items() if self.clock - t >= self.cooldown]
        if self.name == "cost-lrfu" and ready:
            # Gaps and ages in misses (a gap is 1 + the misses between two references).
            gaps = [m[-1] - m[-2] + 1 for m in self.miss_at.values() if len(m) > 1]
            if gaps:
                horizon = self.misses - 3 * sum(gaps) / len(gaps)
                stale = [k for k in ready if self.miss_at[k][-1] < horizon]
                if stale:
                    return [min(stale, key=lambda k: (self.miss_at[k][-1], self.refs[k][-1]))]
        return ready or list(self.refs)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("cooldown", [0, 5])
def test_victims_match_the_definitions(name: str, cooldown: int) -> None:
    params: dict[str, float] = {"cooldown": cooldown}
    if name == "lrfu":
        params.update(p=2, lam=0.05)
    if name == "cost-lrfu":
        params.update(lam=0)
    policy = make_policy(name, **params)
    ref = Reference(name, p=2, lam=0.05, cooldown=cooldown)
    rng = random.Random(3)
    for _ in range(1500):
        key = rng.randrange(30)
        if rng.random() < 0.3 and len(policy):
            victim = policy.victim()
            candidates = ref.candidates()
            assert victim in candidates  # never a cooling entry while another is ready
            best = min(ref.score(k) for k in candidates)
            if name == "lrfu":
                assert ref.score(victim) == pytest.approx(best, rel=1e-9)
            else:
                assert ref.score(victim) == best
            policy.remove(victim)
            ref.remove(victim)
        elif key in policy:
            policy.touch(key)
            ref.reference(key, admit=False)
        else:
            cost = (1.0, 1.2, 3.0, 10.0)[key % 4]
            policy.admit(key, 1, cost)
            ref.reference(key, admit=True)
            ref.costs[key] = cost
        assert len(policy) == len(ref.refs)


# -- persistence ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("clock_first", [True, False])
def test_export_restore_gives_the_same_victims(name: str, clock_first: bool) -> None:
    original = make_policy(name, cooldown=8)
    ops = random_references(4, 2000, 60)
    replay(original, ops)
    clone = make_policy(name, cooldown=8)
    # The index is read back in its own order, and the clock may come first or last.
    keys = sorted(original_keys(original), key=str, reverse=True)
    if clock_first:
        clone.restore_clock(original.export_clock())
    for key in keys:
        clone.restore(key, 100 + key, 0.01 * (1 + key % 3), original.export(key))
    if not clock_first:
        clone.restore_clock(original.export_clock())
    assert clone.clock == original.clock and len(clone) == len(original)
    assert all(isinstance(v, float) for v in original.export(keys[0]))

    more = random_references(5, 500, 60)
    assert replay(clone, more) == replay(original, more)
    assert drain(clone) == drain(original)


def original_keys(policy: EvictionPolicy) -> list[int]:
    return [k for k in range(60) if k in policy]


def test_clock_never_goes_backwards() -> None:
    policy = LRU()
    admit_all(policy, "abc")
    policy.restore_clock(1)
    assert policy.clock == 3
    fresh = LRU()
    fresh.restore("x", 1, 0.0, (5.0, 9.0, 0.0))
    assert fresh.clock == 9  # a later reference must come after the restored ones


# -- edges and construction --------------------------------------------------------------

def test_unknown_keys_are_ignored() -> None:
    for name in POLICIES:
        policy = make_policy(name)
        assert policy.victim() is None
        policy.remove("nope")
        policy.touch("nope")
        assert policy.clock == 0 and len(policy) == 0
        policy.admit("a", 1, 0.0)
        policy.remove("a")
        policy.remove("a")
        assert "a" not in policy and policy.victim() is None


def test_make_policy() -> None:
    assert isinstance(make_policy(), CostAwareLRFU)
    assert eviction.DEFAULT_POLICY == "cost-lrfu"
    assert {type(make_policy(n)) for n in ("lru", "lfu", "lrfu", "cost-lrfu")} == {
        LRU, LFU, LRFU, CostAwareLRFU}
    policy = make_policy("cost-lrfu", p=3, lam=0.01, cooldown=4, tolerance=0.5)
    assert isinstance(policy, CostAwareLRFU)
    assert (policy.p, policy.lam, policy.cooldown, policy.tolerance) == (3, 0.01, 4, 0.5)
    assert eviction.lam_for_half_life(2**15) == 2**-15
    halving = LRFU(lam=eviction.lam_for_half_life(10), cooldown=0)
    halving.admit("a", 1, 0.0)  # t=1
    for _ in range(9):
        halving.admit(object(), 1, 0.0)
    halving.touch("a")  # t=11, 10 references later: CRF = 1 + 1/2
    assert halving.export("a")[2] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="lru, lfu, lrfu, cost-lrfu"):
        make_policy("arc")
    with pytest.raises(TypeError):
        make_policy("lru", lam=0.1)
    with pytest.raises(ValueError):
        make_policy("lrfu", p=0.5)
    with pytest.raises(ValueError):
        make_policy("lru", cooldown=-1)


# -- cost per operation ------------------------------------------------------------------

@pytest.fixture
def ranked(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every entry cost-lrfu ranks from now on, in order (the heaps' main cost)."""
    entries: list[object] = []
    original = CostAwareLRFU._rank

    def counting(self: CostAwareLRFU, entry: object) -> tuple[float, ...]:
        entries.append(entry)
        return original(self, entry)  # type: ignore[arg-type]

    monkeypatch.setattr(CostAwareLRFU, "_rank", counting)
    return entries


def test_work_per_operation_is_bounded(ranked: list[object]) -> None:
    """Eviction must not rescan or re-rank the entries: ranks are computed a bounded
    number of times per operation (lazy invalidation, rebuilds amortised), and the heaps
    stay within a constant factor of the live entries however many references come."""
    policy = CostAwareLRFU(cooldown=16)
    n = 5000
    rng = random.Random(6)
    operations = 0
    for key in range(n):
        policy.admit(key, 100, 0.001)
        operations += 1
    next_key = n
    for _ in range(60_000):
        if rng.random() < 0.5:
            policy.touch(rng.randrange(next_key))
        else:
            victim = policy.victim()
            policy.remove(victim)
            policy.admit(next_key, 100, 0.001 * rng.choice((1, 5)))
            next_key += 1
            operations += 2
        operations += 1
        records = policy._records()
        assert records <= 4 * len(policy) + 1024 + 2
    assert len(policy) == n
    assert len(ranked) <= 4 * operations


def test_many_entries() -> None:
    # Not a timing: a smoke test that a large tier is handled without quadratic work.
    policy = make_policy()
    for key in range(200_000):
        policy.admit(key, 1, 0.0)
    evicted = 0
    while evicted < 1000:
        policy.remove(policy.victim())
        evicted += 1
    assert len(policy) == 199_000
    assert math.isfinite(policy.export(199_999)[2])


# -- the simulator's reference point -----------------------------------------------------

def test_belady_and_replay_on_a_hand_trace() -> None:
    from bench.simulate import Result, Trace, simulate, simulate_min

    trace = Trace("hand", "", keys=[0, 1, 2, 0, 1, 3, 0, 1, 2], sizes=[1] * 4,
                  costs=[1.0, 1.0, 1.0, 5.0])
    # MIN with room for two: 2 and 3 are never worth caching (their next use is the
    # farthest), so 0 and 1 stay and hit twice each.
    best = simulate_min(trace, 2, Result("MIN", 0.5, 2))
    assert (best.hits, best.bytes_fetched, best.fetch_time_s) == (4, 5, 9.0)
    # LRU evicts each key just before its reuse.
    lru = simulate(make_policy("lru", cooldown=0), trace, 2, Result("lru", 0.5, 2))
    assert (lru.hits, lru.refs) == (0, 9)
    # An object larger than the tier is fetched, never admitted.
    big = Trace("big", "", keys=[0, 0], sizes=[3], costs=[1.0])
    for result in (simulate(make_policy(), big, 2, Result("c", 1, 2)),
                   simulate_min(big, 2, Result("MIN", 1, 2))):
        assert (result.hits, result.bytes_fetched) == (0, 6)


def test_entries_are_ranked_once_per_victim_not_once_per_admission_or_hit(
        ranked: list[object]) -> None:
    """A tier that never evicts ranks none of its admissions and hits; when a victim is
    wanted, each entry admitted or referenced since the last one is ranked once, however
    often."""
    policy = CostAwareLRFU(cooldown=0)
    for key in range(100):
        policy.admit(key, 100, 0.001)
    # A tier filling (a cold epoch that fits in it) ranks nothing until a victim is
    # wanted; then each entry once.
    assert not ranked
    policy.victim()
    assert len(ranked) == 100
    ranked.clear()
    records = policy._records()
    rng = random.Random(8)
    touched = {rng.randrange(10) for _ in range(1000)}
    for key in touched:
        policy.touch(key)
    for _ in range(1000):
        policy.touch(rng.randrange(10))
    assert not ranked and policy._records() == records  # hits cost no rank, no record
    assert policy.victim() not in touched  # the hot ten rank above the rest
    assert len(ranked) == len(touched) == 10
    # Most entries referenced since (a warm epoch, then a miss): one rebuild ranks each
    # entry once and leaves no outdated record behind.
    ranked.clear()
    for key in range(100):
        policy.touch(key)
    assert policy.victim() is not None
    assert len(ranked) == len(policy) == 100
    assert policy._records() == 2 * len(policy)  # a rank and a recency record each


def test_a_full_tier_ranks_an_admission_once_its_cool_down_ends(
        ranked: list[object]) -> None:
    """A cold epoch through a full tier: every admission evicts one entry. An entry is
    ranked when its cool-down ends (and at the rebuilds that clear outdated records),
    not also when it arrives: while it cools, nothing but the victim that finds every
    entry cooling (below) ranks it."""
    policy = CostAwareLRFU(cooldown=64)
    for key in range(1000):
        policy.admit(key, 100, 0.001)
    policy.victim()
    ranked.clear()
    for key in range(1000, 11_000):
        victim = policy.victim()
        assert victim is not None and victim < key - 64  # never one still cooling
        policy.remove(victim)
        policy.admit(key, 100, 0.001)
    assert len(ranked) / 10_000 < 2  # 1.56 here; 3.0 when arrivals were ranked too
    # A tier whose every entry cools still gives the lowest-ranked of them.
    small = CostAwareLRFU(cooldown=64)
    for key, cost in enumerate((0.5, 0.001, 0.2)):
        small.admit(key, 100, cost)
    assert small.victim() == 1  # the cheapest to fetch again
