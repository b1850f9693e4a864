"""The hinted prefetch scheduler and the adaptive concurrency as pure code: priorities,
the window and its refill at half, the global budget, several jobs sharing one cache,
order replacement, readers out of order, the counters."""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Callable, Hashable, Sequence

import pytest

from bucketfs.prefetch.concurrency import AdaptiveConcurrency
from bucketfs.prefetch.scheduler import RESYNC_READS, Plan, PrefetchScheduler


def order(prefix: str, count: int, size: int = 100) -> list[tuple[Hashable, int]]:
    return [(f"{prefix}{i}", size) for i in range(count)]


def keys(prefix: str, indices: Sequence[int] | range) -> list[str]:
    return [f"{prefix}{i}" for i in indices]


def fetch_all(scheduler: PrefetchScheduler, limit: int = 1000) -> list[Hashable]:
    """Start what the scheduler says and complete every fetch at once."""
    started = scheduler.next_fetches(limit)
    for key in started:
        scheduler.fetched(key)
    return started


# -- the plan -----------------------------------------------------------------------

def test_plan_positions_and_duplicates() -> None:
    plan = Plan("job", [("a", 1), ("b", 2), ("a", 3), ("c", 4)])
    assert len(plan) == 4 and "a" in plan and "z" not in plan
    assert plan.next_position("a") == 0
    plan.read_ahead.add(0)
    assert plan.next_position("a") == 2
    assert plan.next_position("a", limit=2) is None
    plan.extend([("a", 5)])
    assert plan.next_position("a") == 2
    plan.position = 3
    plan.read_ahead.clear()
    assert plan.next_position("a") == 4
    assert plan.next_position("b") is None
    with pytest.raises(ValueError):
        Plan("job", [("a", -1)])


# -- window and refill ----------------------------------------------------------------

def test_a_new_order_plans_one_window_in_order() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("job", order("f", 50))
    assert scheduler.next_fetches(3) == keys("f", range(3))
    assert scheduler.next_fetches(100) == keys("f", range(3, 10))
    assert scheduler.next_fetches(100) == []


def test_the_window_is_topped_up_once_half_is_read() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("job", order("f", 50))
    fetch_all(scheduler)
    for key in keys("f", range(4)):
        scheduler.observe_read(key)
    assert scheduler.stats().window_bytes == 600
    assert scheduler.next_fetches(100) == []  # more than half is still unread
    scheduler.observe_read("f4")
    assert scheduler.next_fetches(100) == keys("f", range(10, 15))
    assert scheduler.stats().window_bytes == 1000


def test_an_object_larger_than_the_window_is_still_planned() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("job", [("big", 5000), ("small", 10)])
    assert scheduler.next_fetches(10) == ["big"]
    scheduler.fetched("big")
    scheduler.observe_read("big")
    assert scheduler.next_fetches(10) == ["small"]


def test_cached_keys_are_not_fetched_but_fill_the_window() -> None:
    cached = set(keys("f", range(0, 10, 2)))
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("job", order("f", 50))
    assert scheduler.next_fetches(100, cached.__contains__) == keys("f", range(1, 10, 2))


# -- priorities -----------------------------------------------------------------------

def test_nearest_items_first_across_jobs() -> None:
    scheduler = PrefetchScheduler(window_bytes=500, budget_bytes=10_000)
    scheduler.set_order("a", order("a", 20))
    scheduler.set_order("b", order("b", 20))
    fetch_all(scheduler)
    for key in keys("a", range(3)):  # a's reader is ahead: its new items are far
        scheduler.observe_read(key)
    # a refilled at half: a5..a7 are 2-4 items ahead of a's reader (at 3); nothing for b
    assert scheduler.next_fetches(10) == ["a5", "a6", "a7"]


def test_jobs_take_turns_so_a_huge_order_cannot_starve_a_small_one() -> None:
    scheduler = PrefetchScheduler(window_bytes=100_000, budget_bytes=1_000_000)
    scheduler.set_order("huge", order("h", 100_000))
    scheduler.set_order("small", order("s", 5))
    started = scheduler.next_fetches(8)
    assert started == ["h0", "s0", "h1", "s1", "h2", "s2", "h3", "s3"]


def test_a_key_planned_by_several_jobs_is_fetched_once() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("a", order("f", 10))
    scheduler.set_order("b", list(reversed(order("f", 10))))
    started = scheduler.next_fetches(100)
    assert sorted(started) == sorted(keys("f", range(10)))
    assert len(started) == len(set(started)) == 10
    for key in started:
        scheduler.fetched(key)
    scheduler.observe_read("f0", job="a")
    scheduler.observe_read("f0", job="b")
    assert scheduler.stats().prefetch_hits == 2
    assert scheduler.stats().held_bytes == 900  # f0 is read by both: released


# -- the budget -----------------------------------------------------------------------

def test_the_budget_bounds_in_flight_plus_fetched_unread_over_all_jobs() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=1500)
    scheduler.set_order("a", order("a", 50))
    scheduler.set_order("b", order("b", 50))
    first = fetch_all(scheduler)
    assert len(first) == 15
    stats = scheduler.stats()
    assert stats.held_bytes == 1500 and stats.inflight_bytes == 0
    assert scheduler.next_fetches(100) == []
    scheduler.observe_read("a0")
    scheduler.observe_read("b0")
    assert scheduler.stats().held_bytes == 1300
    assert len(scheduler.next_fetches(100)) == 2  # 200 bytes came free


def test_strict_priority_under_the_budget() -> None:
    scheduler = PrefetchScheduler(window_bytes=10_000, budget_bytes=1000)
    scheduler.set_order("job", [("a", 600), ("b", 600), ("c", 100)])
    # b does not fit; c would, but does not jump ahead of b
    assert scheduler.next_fetches(10) == ["a"]


# -- replacing orders -----------------------------------------------------------------

def test_a_new_order_drops_the_old_plan_and_returns_what_to_cancel() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("job", order("f", 50))
    assert scheduler.next_fetches(4) == keys("f", range(4))
    # the next epoch starts with f2 and f3, then other files
    cancel = scheduler.set_order("job", [("f3", 100), ("f2", 100), *order("g", 20)])
    assert cancel == ["f0", "f1"]
    assert scheduler.next_fetches(100) == keys("g", range(8))  # f4..f9 are dropped
    for key in cancel:
        scheduler.cancelled(key)
    assert scheduler.stats().inflight_bytes == 10 * 100


def test_a_key_another_job_wants_is_not_cancelled() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("a", order("f", 10))
    scheduler.set_order("b", order("f", 10))
    scheduler.next_fetches(100)
    assert scheduler.end_job("a") == []
    assert sorted(scheduler.end_job("b")) == sorted(keys("f", range(10)))
    assert scheduler.end_job("nobody") == []


def test_a_fetch_a_reader_waits_on_is_never_cancelled() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("a", order("f", 10))
    scheduler.next_fetches(2)
    scheduler.observe_read("f0")  # late: the reader now waits on the prefetch
    assert scheduler.stats().late_prefetches == 1
    assert scheduler.set_order("a", order("g", 10)) == ["f1"]


def test_a_cancelled_key_wanted_again_is_planned_again() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("a", order("f", 10))
    scheduler.next_fetches(1)
    assert scheduler.set_order("a", order("g", 10)) == ["f0"]
    scheduler.set_order("b", order("f", 1))  # f0 is wanted again before the cancel lands
    scheduler.cancelled("f0")
    assert "f0" in scheduler.next_fetches(100)


def test_append_order_extends_the_plan() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=10_000)
    scheduler.set_order("job", order("f", 3))
    version = scheduler.plans_version
    assert scheduler.append_order("job", order("g", 20)) == []
    assert scheduler.plans_version > version
    assert scheduler.next_fetches(100) == keys("f", range(3)) + keys("g", range(7))
    assert scheduler.append_order("new", order("n", 1)) == []
    assert "n0" in scheduler.next_fetches(100)


# -- following the reader -----------------------------------------------------------

def worker_reads(batch: int, workers: int, batches: int) -> list[int]:
    """Positions in the order several DataLoader workers read them: worker w loads
    batches w, w + workers, ...; their reads interleave item by item."""
    reads: list[int] = []
    for first in range(0, batches, workers):
        group = [range(b * batch, (b + 1) * batch)
                 for b in range(first, min(first + workers, batches))]
        for i in range(batch):
            reads += [items[i] for items in group]
    return reads


def test_reads_out_of_order_from_several_workers_advance_the_reader() -> None:
    scheduler = PrefetchScheduler(window_bytes=2000, budget_bytes=100_000, lookahead=64)
    scheduler.set_order("job", order("f", 96))
    plan = scheduler.plans["job"]
    reads = worker_reads(batch=8, workers=4, batches=12)
    for n, position in enumerate(reads[:20], 1):
        scheduler.observe_read(f"f{position}")
        assert plan.position <= min(set(range(96)) - set(reads[:n]))
    for position in reads[20:]:
        scheduler.observe_read(f"f{position}")
    assert plan.position == 96 and not plan.read_ahead and plan.remaining == 0
    assert scheduler.stats().window_bytes == 0


def test_items_left_far_behind_are_given_up() -> None:
    scheduler = PrefetchScheduler(window_bytes=10_000, budget_bytes=100_000, lookahead=8)
    scheduler.set_order("job", order("f", 100))
    plan = scheduler.plans["job"]
    scheduler.observe_read("f0")
    for i in range(2, 12):  # f1 is never seen (the page cache served it)
        scheduler.observe_read(f"f{i}")
    assert plan.position == 12
    assert scheduler.stats().window_bytes == (plan.frontier - 12) * 100


def test_reads_too_far_ahead_or_unplanned_do_nothing() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=100_000, lookahead=8)
    scheduler.set_order("job", order("f", 100))
    scheduler.observe_read("f50")
    scheduler.observe_read("other")
    plan = scheduler.plans["job"]
    assert plan.position == 0 and not plan.read_ahead


def test_a_long_run_the_daemon_never_saw_is_crossed() -> None:
    """With kernel_opens the kernel serves page-cached files without telling the daemon:
    a run far longer than the look-ahead must not stick the plan."""
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=100_000, lookahead=16)
    scheduler.set_order("job", order("f", 1000))
    plan = scheduler.plans["job"]
    fetch_all(scheduler)
    for i in range(500, 500 + RESYNC_READS - 1):  # f0..f499 came from the page cache
        scheduler.observe_read(f"f{i + (i % 2)}")  # a little out of order
    assert plan.position == 0
    scheduler.observe_read(f"f{500 + RESYNC_READS}")
    # As for near reads: what lies over lookahead / 2 behind the newest read is given up.
    assert plan.position == 500 + RESYNC_READS - 16 // 2
    assert {500, 502, 500 + RESYNC_READS} <= plan.read_ahead
    # The window is ahead of the reader again (ten unread items fill its 1000 bytes).
    unread = [496, 497, 498, 499, 501, 503, *range(505, 509)]
    assert set(fetch_all(scheduler)) == set(keys("f", unread))
    for i in range(500, 520):
        scheduler.observe_read(f"f{i}")
    assert plan.position == 520 and not plan.far_reads


def test_far_reads_spread_over_the_order_move_nothing() -> None:
    """Another job's reads land anywhere in this job's order: no jump."""
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=100_000, lookahead=16)
    scheduler.set_order("job", order("f", 1000))
    plan = scheduler.plans["job"]
    for i in (300, 620, 910, 450, 130, 770, 240, 990):
        scheduler.observe_read(f"f{i}")
    assert plan.position == 0 and not plan.read_ahead


def test_a_read_attributed_to_a_job_moves_only_that_job() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=100_000)
    scheduler.set_order("a", order("f", 10))
    scheduler.set_order("b", order("f", 10))
    scheduler.observe_read("f0", job="a")
    assert scheduler.plans["a"].position == 1 and scheduler.plans["b"].position == 0
    scheduler.observe_read("f1")
    assert scheduler.plans["a"].position == 2
    assert scheduler.plans["b"].read_ahead == {1}
    scheduler.observe_read("f2", job="nobody")
    assert scheduler.plans["a"].position == 2


def test_a_key_read_twice_in_one_order() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=100_000)
    scheduler.set_order("job", [("a", 10), ("b", 10), ("a", 10)])
    assert scheduler.next_fetches(10) == ["a", "b"]  # fetched once
    for key in ("a", "b", "a"):
        scheduler.observe_read(key)
    assert scheduler.plans["job"].position == 3


# -- feedback and counters --------------------------------------------------------------

def test_hit_late_and_wasted_counters() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=100_000)
    scheduler.set_order("job", order("f", 20))
    assert scheduler.next_fetches(3) == ["f0", "f1", "f2"]
    scheduler.fetched("f0")
    scheduler.fetched("f2")
    scheduler.observe_read("f0")  # found fetched: a hit
    scheduler.observe_read("f1")  # still in flight: late
    scheduler.evicted("f2")  # dropped before its read: wasted, and planned again
    stats = scheduler.stats()
    assert (stats.prefetch_hits, stats.late_prefetches, stats.wasted_prefetches) == (1, 1, 1)
    assert "f2" in scheduler.next_fetches(100)
    assert stats.inflight_bytes == 100 and stats.held_bytes == 0
    assert stats.prefetches_started == 3


def test_a_failed_fetch_is_not_retried_by_prefetch() -> None:
    scheduler = PrefetchScheduler(window_bytes=300, budget_bytes=100_000)
    scheduler.set_order("job", order("f", 20))
    assert scheduler.next_fetches(1) == ["f0"]
    scheduler.failed("f0")
    scheduler.failed("unknown")
    assert scheduler.next_fetches(100) == ["f1", "f2"]
    assert scheduler.stats().failed_fetches == 1
    assert scheduler.stats().inflight_bytes == 200


def test_stats_gauges() -> None:
    scheduler = PrefetchScheduler(window_bytes=1000, budget_bytes=100_000)
    scheduler.set_order("a", order("a", 30))
    scheduler.set_order("b", order("b", 5))
    scheduler.next_fetches(4)
    scheduler.observe_read("a0")
    stats = scheduler.stats()
    assert stats.hinted_items == 29 + 5
    assert stats.window_bytes == 900 + 500
    assert stats.inflight_bytes == 400
    assert scheduler.claimed("a1") and not scheduler.claimed("a0")
    assert sorted(scheduler.in_flight()) == ["a0", "a1", "b0", "b1"]


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        PrefetchScheduler(window_bytes=0, budget_bytes=1)


# -- adaptive concurrency -------------------------------------------------------------

def link(connections: int, per_connection: float = 10e6, cap: float = 160e6) -> float:
    """Bytes per second on a link where each GET gets `per_connection` up to a cap."""
    return min(connections * per_connection, cap)


def drive(control: AdaptiveConcurrency, periods: int, *, start: float = 0.0,
          fetches_per_stream: int = 4, fail_in: Sequence[int] = (),
          busy: float = 1.0, throughput: Callable[[int], float] = link,
          noise: random.Random | None = None) -> list[int]:
    """Run `periods` one-second periods at the controller's target: each of `target`
    streams does back-to-back GETs (only `busy` of the time) on a link that carries
    `throughput(streams)` bytes per second, give or take 10% when there is `noise`;
    returns the targets."""
    targets = []
    for n in range(periods):
        control.update(start + n)
        level = control.target
        duration = 0.999 * busy / fetches_per_stream  # all end within the period
        carried = throughput(level) * (noise.uniform(0.9, 1.1) if noise else 1.0)
        nbytes = int(carried * busy / level / fetches_per_stream)
        t0 = start + n
        for stream in range(level):
            for i in range(fetches_per_stream):
                began = t0 + i * duration + stream * 1e-6
                ok = not (n in fail_in and stream == 0 and i == 0)
                control.record(began, began + duration, nbytes, ok=ok)
        control.update(t0 + 1.0)
        targets.append(control.target)
    return targets


def held_level(targets: list[int]) -> tuple[int, float]:
    """The level held most often, and the share of periods spent at it."""
    level, count = collections.Counter(targets).most_common(1)[0]
    return level, count / len(targets)


def test_concurrency_climbs_until_the_link_is_full_and_stays() -> None:
    control = AdaptiveConcurrency(minimum=2, maximum=64, period_s=1.0)
    targets = drive(control, 60)
    knee = 16  # 160 MB/s / 10 MB/s per GET
    level, share = held_level(targets[20:])
    assert knee <= level < knee * 1.5  # the first step at or past the knee
    assert share >= 0.7  # the rest is trials, one step up or down
    assert max(targets) <= math.ceil(level * 1.5)  # trials overshoot by one step at most
    assert targets[:6] == sorted(targets[:6])  # climbs from the start


def test_concurrency_started_too_high_comes_down_to_the_knee() -> None:
    # More GETs than the link needs only split its bandwidth: the reader's next file
    # arrives later. The level must come down, not stay where it started.
    control = AdaptiveConcurrency(minimum=2, maximum=64, initial=48, period_s=1.0)
    targets = drive(control, 80)
    level, _ = held_level(targets[40:])
    assert 16 <= level < 16 * 1.5


def test_noise_does_not_drive_the_concurrency_up_on_a_full_link() -> None:
    # A thin link, full with 4 GETs; every period's throughput is off by up to 10%.
    def thin(connections: int) -> float:
        return link(connections, per_connection=1.5e6, cap=6e6)

    control = AdaptiveConcurrency(minimum=2, maximum=24, initial=8, period_s=1.0)
    targets = drive(control, 300, throughput=thin, noise=random.Random(7))
    settled = sorted(targets[60:])
    assert settled[len(settled) // 2] <= 6  # the median: at the knee's step (4 or 6)
    assert settled[int(len(settled) * 0.9)] <= 9  # rarely a step above it


def test_concurrency_is_deterministic() -> None:
    runs = [drive(AdaptiveConcurrency(minimum=2, maximum=64), 40) for _ in range(2)]
    assert runs[0] == runs[1]


def test_errors_halve_the_concurrency() -> None:
    control = AdaptiveConcurrency(minimum=2, maximum=64)
    drive(control, 30)
    before = control.target
    targets = drive(control, 1, start=30, fail_in=[0])
    assert targets[-1] == max(2, before // 2)
    # and it holds there for a while before probing up again
    assert drive(control, 5, start=31) == [targets[-1]] * 5


def test_idle_periods_change_nothing() -> None:
    control = AdaptiveConcurrency(minimum=2, maximum=64)
    drive(control, 6)
    level = control.target
    assert drive(control, 20, start=6, busy=0.3) == [level] * 20  # readers need less
    control.update(1000.0)  # a long pause
    assert control.target == level


def test_concurrency_bounds() -> None:
    control = AdaptiveConcurrency(minimum=3, maximum=5, initial=100)
    assert control.target == 5
    drive(control, 20)
    assert control.target == 5
    with pytest.raises(ValueError):
        AdaptiveConcurrency(minimum=0)
