"""What to fetch next when the readers' future order is known (hinted prefetch).

Each training job sends the order in which it will read the files of an epoch. The
scheduler keeps one `Plan` per job: that order, and where the job's reader is in it. It
answers one question, `next_fetches(limit)`: which objects to start fetching now.

The policy:

- The reader's position follows observed reads, never the clock: `observe_read(key)`
  finds the key at or a little beyond the position (within `lookahead` items), so
  several DataLoader workers reading the items of a few batches out of order still
  advance the job. The position is the first item not yet read; items read ahead of it
  are remembered until it catches up. An item left unread more than `lookahead` / 2
  items behind the newest read counts as skipped (the kernel's page cache served it, or
  the dataset skipped it), so the position never sticks. A longer run that the daemon
  never saw (the kernel opening files itself and serving them from its page cache) is
  crossed when `RESYNC_READS` reads in a row land beyond the look-ahead, close together
  (within `lookahead` / 2): the position jumps to them. Reads spread wide over the order
  are another job's, and move nothing. `lookahead` must exceed twice
  the spread of the readers' reads (workers x prefetch_factor x batch size); the
  default, 2048 items, covers 8 workers x 2 batches of 64 twice over.
- Several jobs reading the same files: the daemon should say which job read
  (`observe_read(key, job)`). Without that, a read advances every job that has the key
  within its look-ahead, and one job's reads can mark another's items as read early.
- The window (DELI, proxy prefetch): the items from the position up to the job's
  frontier are planned: fetched, in flight, or about to be. Their unread bytes stay
  within `window_bytes`. The window is topped up to `window_bytes` only once the reader
  has consumed half of it (DELI's best setting: fetch size = threshold = half), so
  fetches are started in groups, not one per read. An item already in the cache is part
  of the window too: the window is "data ready ahead of the reader".
- The budget: bytes in flight plus bytes fetched by prefetch and not yet read, over all
  jobs together, stay within `budget_bytes` (one object larger than the budget may go
  when nothing else is held, so a huge file cannot stall the plan forever).
- Priorities: planned items nearest to their job's reader (distance in items), merged
  across jobs so equal distances alternate between jobs: a job with a huge order cannot
  starve another. (A reader that misses fetches its block itself, through the cache's
  single flight: prefetch has nothing to add to that.) A key is never started twice:
  not while in flight, not once fetched, and not when `is_cached(key)` says the cache
  already holds it. Jobs that plan the same key
  share one fetch.
- A new order for a job (`set_order`) replaces its plan; what only the old plan wanted
  and has not started is dropped, and the keys in flight that no plan wants any more
  are returned so the daemon can cancel them.

How many GETs to keep in flight is `concurrency.AdaptiveConcurrency`'s to say.

Everything is pure and deterministic: no clocks, no I/O, no threads. The daemon calls it
from one thread (trio's), between awaits.
"""

from __future__ import annotations

import bisect
import collections
import heapq
from array import array
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass

__all__ = [
    "Plan",
    "PrefetchScheduler",
    "PrefetchStats",
]

Key = Hashable
Order = Iterable[tuple[Key, int]]

DEFAULT_LOOKAHEAD = 2048
#: Reads in a row beyond the look-ahead, close together, that move the position to them.
RESYNC_READS = 4


class Plan:
    """One job's hinted order (keys with their sizes in bytes) and its reader's place in
    it. Positions are absolute indices into the order and never change while the plan
    lives, which is what lets `future.HintedPolicy` keep heaps keyed on them. The
    scheduler owns and updates it; `future.NextUse` only reads it."""

    __slots__ = ("_index", "epoch_items", "far_reads", "frontier", "job", "keys", "pending",
                 "position", "read_ahead", "sizes", "unread_bytes")

    def __init__(self, job: Hashable, order: Order) -> None:
        self.job = job
        self.keys: list[Key] = []
        self.sizes = array("q")
        # key -> its position, or the sorted list of its positions when it occurs more
        # than once (sampling with replacement); one int per key keeps 1M paths small.
        self._index: dict[Key, int | list[int]] = {}
        #: The first position not yet read (nor given up as skipped).
        self.position = 0
        #: Positions read beyond `position`, until the position catches up with them.
        self.read_ahead: set[int] = set()
        #: Positions below it have been planned (the window is [position, frontier)).
        self.frontier = 0
        #: Bytes of the unread items in the window.
        self.unread_bytes = 0
        #: Heap of planned positions whose key may still need a fetch (checked lazily).
        self.pending: list[int] = []
        #: Items in the latest order given (one epoch, as the job announces them).
        self.epoch_items = 0
        #: Positions of the latest reads in a row found beyond the look-ahead.
        self.far_reads: collections.deque[int] = collections.deque(maxlen=RESYNC_READS)
        self.extend(order)

    def extend(self, order: Order) -> None:
        """Append items (the next epoch, known early) after the current ones."""
        first = len(self.keys)
        for key, size in order:
            if size < 0:
                raise ValueError(f"negative size for {key!r}")
            position = len(self.keys)
            self.keys.append(key)
            self.sizes.append(size)
            found = self._index.get(key)
            if found is None:
                self._index[key] = position
            elif isinstance(found, int):
                self._index[key] = [found, position]
            else:
                found.append(position)
        self.epoch_items = len(self.keys) - first

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    @property
    def remaining(self) -> int:
        """Items not read yet."""
        return len(self.keys) - self.position - len(self.read_ahead)

    def is_read(self, position: int) -> bool:
        return position < self.position or position in self.read_ahead

    def next_position(self, key: Key, limit: int | None = None) -> int | None:
        """The first unread position of `key` at or after the reader's position and
        before `limit` (no limit: anywhere ahead); None if there is none."""
        found = self._index.get(key)
        if found is None:
            return None
        end = len(self.keys) if limit is None else min(limit, len(self.keys))
        if isinstance(found, int):
            ok = self.position <= found < end and found not in self.read_ahead
            return found if ok else None
        i = bisect.bisect_left(found, self.position)
        while i < len(found) and found[i] < end:
            if found[i] not in self.read_ahead:
                return found[i]
            i += 1
        return None

    def in_window(self, position: int) -> bool:
        return self.position <= position < self.frontier


@dataclass(frozen=True, slots=True)
class PrefetchStats:
    """A snapshot for the metrics endpoint. Gauges first, then counters since start."""

    #: Items still ahead of the readers, over all plans.
    hinted_items: int
    #: Unread bytes planned ahead of the readers (the jobs' windows together).
    window_bytes: int
    inflight_bytes: int
    #: Bytes fetched by prefetch that a plan still waits to read (charged to the budget).
    held_bytes: int
    #: Reads that found their data already fetched by prefetch.
    prefetch_hits: int
    #: Reads that arrived while their prefetch was still in flight.
    late_prefetches: int
    #: Prefetched objects evicted before anyone read them.
    wasted_prefetches: int
    prefetches_started: int
    failed_fetches: int


def _never_cached(key: Key) -> bool:
    return False


class PrefetchScheduler:
    """The plan of what to fetch next, for several jobs at once. See the module
    docstring for the policy.

    Who calls what:
    - the hint server, when a job sends an order: `set_order` (a new epoch),
      `append_order` (the next epoch, known early), `end_job` (its connection closed:
      until then `future.HintedPolicy` expects the job to read its files again next
      epoch); all three return keys in flight that nobody needs any more: cancel them;
    - the read path, once per file read (on the first read of an open handle), before
      the cache lookup: `observe_read(key)`;
    - the prefetch task, whenever a fetch ends, an order arrives or a read was observed
      (the window refills as the reader moves): `next_fetches(limit, is_cached)` with
      `limit` = the concurrency target minus the fetches in flight, then for each key
      it started exactly one of `fetched`, `failed` or `cancelled`;
    - the cache, when an object leaves it entirely (no tier holds it any more):
      `evicted(key)`.

    `is_cached(key)` is asked just before a key would be started; it must say whether
    the cache (any tier) already holds the whole object. It is the one way the scheduler
    learns about data it did not fetch itself (read by a reader, or kept from an earlier
    epoch).
    """

    def __init__(self, *, window_bytes: int, budget_bytes: int,
                 lookahead: int = DEFAULT_LOOKAHEAD) -> None:
        if window_bytes <= 0 or budget_bytes <= 0 or lookahead <= 0:
            raise ValueError("window_bytes, budget_bytes and lookahead must be > 0")
        self.window_bytes = window_bytes
        self.budget_bytes = budget_bytes
        self.lookahead = lookahead
        self.plans: dict[Hashable, Plan] = {}
        #: Bumped whenever a plan is added, replaced, extended or dropped; positions
        #: within a plan never change, so this is all `future.NextUse` needs to watch.
        self.plans_version = 0
        self._claims: dict[Key, int] = {}  # key -> unread window slots holding it
        self._inflight: dict[Key, int] = {}  # key -> bytes
        self._held: dict[Key, int] = {}  # fetched by us, still claimed -> bytes
        # Prefetches in flight that lost their last claim during the current order
        # change (a read releasing a claim is not one: a reader waits on that fetch).
        self._orphans: list[Key] = []
        self.inflight_bytes = 0
        self.held_bytes = 0
        self.prefetch_hits = 0
        self.late_prefetches = 0
        self.wasted_prefetches = 0
        self.prefetches_started = 0
        self.failed_fetches = 0

    # -- orders -----------------------------------------------------------------------
    def set_order(self, job: Hashable, order: Order) -> list[Key]:
        """Install or replace `job`'s plan (a new epoch). Returns the keys in flight
        that no plan wants any more (cancel them, then report `cancelled`)."""
        self._orphans.clear()
        old = self.plans.pop(job, None)
        if old is not None:
            self._drop_window(old)
        plan = self.plans[job] = Plan(job, order)
        self.plans_version += 1
        self._refill(plan)
        return self._take_orphans()

    def append_order(self, job: Hashable, order: Order) -> list[Key]:
        """Extend `job`'s plan with the order after it (the next epoch, known early);
        like `set_order` when the job has no plan."""
        plan = self.plans.get(job)
        if plan is None:
            return self.set_order(job, order)
        self._orphans.clear()
        plan.extend(order)
        self.plans_version += 1
        self._refill(plan)
        return self._take_orphans()

    def end_job(self, job: Hashable) -> list[Key]:
        """Forget `job`. Returns keys in flight that no plan wants any more."""
        self._orphans.clear()
        plan = self.plans.pop(job, None)
        if plan is None:
            return []
        self._drop_window(plan)
        self.plans_version += 1
        return self._take_orphans()

    # -- reads ------------------------------------------------------------------------
    def observe_read(self, key: Key, job: Hashable | None = None) -> None:
        """A reader started reading `key` (call once per file read, before the cache
        lookup). Advances `job`, or when the daemon cannot tell which job read it, every
        job whose order has the key within `lookahead` items of its position. Counts a
        prefetch hit or a late prefetch. Keys in no plan only count."""
        if key in self._held:
            self.prefetch_hits += 1
        elif key in self._inflight:
            self.late_prefetches += 1
        if job is None:
            plans: Iterable[Plan] = self.plans.values()
        else:
            plan = self.plans.get(job)
            plans = () if plan is None else (plan,)
        for plan in plans:
            position = plan.next_position(key, plan.position + self.lookahead)
            if position is not None:
                plan.far_reads.clear()
                self._mark_read(plan, position)
            elif (far := plan.next_position(key)) is not None:
                self._read_far_ahead(plan, far)

    # -- fetching ---------------------------------------------------------------------
    def next_fetches(self, limit: int,
                     is_cached: Callable[[Key], bool] = _never_cached) -> list[Key]:
        """Up to `limit` keys to start now, most urgent first; each is in flight from
        now on until `fetched`, `failed` or `cancelled` is called for it. Keys for which
        `is_cached` says so are not started (see the class docstring)."""
        started: list[Key] = []
        self._start_planned(limit, started, is_cached)
        return started

    def fetched(self, key: Key) -> None:
        """A fetch started by `next_fetches` finished: the object is in the cache."""
        size = self._inflight.pop(key, None)
        if size is None:
            return
        self.inflight_bytes -= size
        if self._claims.get(key) and key not in self._held:
            self._held[key] = size
            self.held_bytes += size

    def failed(self, key: Key) -> None:
        """A fetch failed (after the store's own retries). Not planned again: the
        reader's own read will try once more and report the error."""
        if self._finish(key):
            self.failed_fetches += 1

    def cancelled(self, key: Key) -> None:
        """A fetch was cancelled. If a plan wants the key again by now, it is re-planned."""
        if self._finish(key) and self._claims.get(key):
            self._replan(key)

    def evicted(self, key: Key) -> None:
        """The cache no longer holds `key` at all. If prefetch fetched it and it was not
        read yet, that prefetch was wasted; a key still ahead of a reader is planned
        again."""
        size = self._held.pop(key, None)
        if size is not None:
            self.held_bytes -= size
            self.wasted_prefetches += 1
        if self._claims.get(key):
            self._replan(key)

    # -- metrics ----------------------------------------------------------------------
    def stats(self) -> PrefetchStats:
        return PrefetchStats(
            hinted_items=sum(plan.remaining for plan in self.plans.values()),
            window_bytes=sum(plan.unread_bytes for plan in self.plans.values()),
            inflight_bytes=self.inflight_bytes,
            held_bytes=self.held_bytes,
            prefetch_hits=self.prefetch_hits,
            late_prefetches=self.late_prefetches,
            wasted_prefetches=self.wasted_prefetches,
            prefetches_started=self.prefetches_started,
            failed_fetches=self.failed_fetches,
        )

    def in_flight(self) -> Iterator[Key]:
        return iter(self._inflight)

    def claimed(self, key: Key) -> bool:
        """Whether some job's window still waits to read `key`."""
        return bool(self._claims.get(key))

    # -- internals --------------------------------------------------------------------
    def _read_far_ahead(self, plan: Plan, position: int) -> None:
        """A read of `position`, beyond the look-ahead: after `RESYNC_READS` such reads
        close together, the reader is there, and what lies before them was skipped."""
        far = plan.far_reads
        far.append(position)
        if len(far) < RESYNC_READS or max(far) - min(far) >= self.lookahead // 2:
            return
        positions = sorted(set(far))
        far.clear()
        self._advance(plan, positions[0] - self.lookahead // 2)
        for read in positions:
            if read >= plan.position and read not in plan.read_ahead:
                self._mark_read(plan, read)

    def _mark_read(self, plan: Plan, position: int) -> None:
        if position < plan.frontier:
            plan.unread_bytes -= plan.sizes[position]
            self._release(plan.keys[position])
        if position == plan.position:
            plan.position += 1
        else:
            plan.read_ahead.add(position)
        self._advance(plan, position - self.lookahead // 2)

    def _advance(self, plan: Plan, floor: int) -> None:
        """Move the position past items read ahead and past unread items before `floor`
        (given up as skipped)."""
        end = len(plan.keys)
        while plan.position < end and (plan.position in plan.read_ahead
                                       or plan.position < floor):
            position = plan.position
            if position in plan.read_ahead:
                plan.read_ahead.discard(position)
            elif position < plan.frontier:
                plan.unread_bytes -= plan.sizes[position]
                self._release(plan.keys[position])
            plan.position += 1
        plan.frontier = max(plan.frontier, plan.position)
        while plan.pending and plan.pending[0] < plan.position:
            heapq.heappop(plan.pending)
        self._refill(plan)

    def _refill(self, plan: Plan) -> None:
        # DELI: top up only once half the window has been consumed.
        if plan.unread_bytes > self.window_bytes // 2:
            return
        end = len(plan.keys)
        while plan.frontier < end:
            position = plan.frontier
            size = plan.sizes[position]
            if position not in plan.read_ahead:
                if plan.unread_bytes and plan.unread_bytes + size > self.window_bytes:
                    break
                key = plan.keys[position]
                self._claims[key] = self._claims.get(key, 0) + 1
                plan.unread_bytes += size
                heapq.heappush(plan.pending, position)
            plan.frontier += 1

    def _drop_window(self, plan: Plan) -> None:
        for position in range(plan.position, plan.frontier):
            if position not in plan.read_ahead:
                self._release(plan.keys[position])
        plan.unread_bytes = 0
        plan.pending.clear()

    def _release(self, key: Key) -> None:
        count = self._claims[key] - 1
        if count:
            self._claims[key] = count
            return
        del self._claims[key]
        size = self._held.pop(key, None)
        if size is not None:
            self.held_bytes -= size  # read (or given up): the budget is free again
        if key in self._inflight:
            self._orphans.append(key)

    def _take_orphans(self) -> list[Key]:
        orphans = [key for key in dict.fromkeys(self._orphans)
                   if key in self._inflight and not self._claims.get(key)]
        self._orphans.clear()
        return orphans

    def _replan(self, key: Key) -> None:
        for plan in self.plans.values():
            position = plan.next_position(key, plan.frontier)
            if position is not None:
                heapq.heappush(plan.pending, position)

    def _finish(self, key: Key) -> bool:
        size = self._inflight.pop(key, None)
        if size is None:
            return False
        self.inflight_bytes -= size
        return True

    def _start(self, key: Key, size: int) -> None:
        self._inflight[key] = size
        self.inflight_bytes += size
        self.prefetches_started += 1

    def _head(self, plan: Plan, is_cached: Callable[[Key], bool]) -> int | None:
        """The plan's nearest planned position that still needs a fetch; drops the
        ones that do not (read, in flight, fetched, cached)."""
        pending = plan.pending
        while pending:
            position = pending[0]
            key = plan.keys[position]
            if (plan.is_read(position) or key in self._inflight or key in self._held
                    or is_cached(key)):
                heapq.heappop(pending)
                continue
            return position
        return None

    def _start_planned(self, limit: int, started: list[Key],
                       is_cached: Callable[[Key], bool]) -> None:
        # A k-way merge of the plans' pending heaps by distance from each reader; among
        # equal distances the plan served fewer times in this call goes first.
        served = dict.fromkeys(self.plans, 0)
        order = {job: i for i, job in enumerate(self.plans)}
        # A head carries how many keys had started when it was found: only a start since
        # (another plan's, of the same key) can have made it stale.
        heads: list[tuple[int, int, int, Hashable, int]] = []
        for job, plan in self.plans.items():
            position = self._head(plan, is_cached)
            if position is not None:
                heads.append((position - plan.position, 0, order[job], job, len(started)))
        heapq.heapify(heads)
        while heads and limit > 0:
            distance, _, rank, job, found_at = heapq.heappop(heads)
            plan = self.plans[job]
            if found_at == len(started):
                position = plan.position + distance
            else:  # another plan's start may have taken its key
                found = self._head(plan, is_cached)
                if found is None:
                    continue
                position = found
            size = plan.sizes[position]
            held = self.inflight_bytes + self.held_bytes
            if held and held + size > self.budget_bytes:
                return  # strict priority: nothing farther jumps the queue
            heapq.heappop(plan.pending)
            key = plan.keys[position]
            self._start(key, size)
            started.append(key)
            limit -= 1
            served[job] += 1
            if not limit:
                return
            found = self._head(plan, is_cached)
            if found is not None:
                heapq.heappush(heads, (found - plan.position, served[job], rank, job,
                                       len(started)))
