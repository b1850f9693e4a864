"""Eviction with the future known (hinted eviction).

`NextUse` reads the jobs' plans (`scheduler.Plan`: each job's order and its reader's
position) and answers, for an object, when it is read next:
- hinted: the plan and absolute position of its nearest unread use in any order;
- expected again: every use in a plan's order has been read, but the job goes on with
  another epoch of the same files, where the object's place is not known yet: expected
  `remaining + epoch / 2` items away (the rest of this epoch, then half of the next);
  the plan that would read it soonest is the one it is filed under. This assumes that a
  job whose plan is still there reads its files again (the daemon ends the job when
  its hint connection closes); `expect_rereads=False` turns it off;
- neither (no plan has it): no hinted future.

`HintedPolicy` is an `EvictionPolicy` (prefetch/eviction.py) for a cache tier whose
entries map to hinted objects through `key_of(entry)` (the daemon's entries are blocks;
`key_of` gives the file's key). The victim is chosen in this order:

1. Entries with no hinted future, in the fallback policy's order (the configured policy,
   e.g. cost-lrfu): data no job announced, or whose job has ended.
2. Then entries whose next use is outside every reader's window before those inside it:
   never evict something hinted to be read within the window while anything else is
   left (the scheduler is fetching that window right now).
3. Among those, the largest weighted distance: distance to the next use in items
   (expected, for objects a job has read this epoch), divided by the entry's refetch
   cost per byte relative to `reference_cost_per_byte` (1e-8 s/byte: a 100 MB/s origin).
   Costs per byte are put in classes of ratio 1 + `cost_tolerance` (rounded on a log
   scale, so measurement noise does not split equal costs); an unknown cost (0) counts as
   the reference. An entry twice as expensive per byte to fetch again is kept as if its
   next use were twice as near. Entries with the same expected distance and cost class
   go in the fallback's order. With equal costs and the whole future announced this is
   exactly Belady's MIN: the farthest next use goes first (an entry no plan reads again
   is as good as any other such entry).

`NextUse.distance` serves the SSD tier, which cannot keep a heap per entry: it ranks a
few candidates from the ends of its eviction order instead
(bucketfs/cache/hinted_victims.py).

Efficiency (1M entries): no scan per victim. Positions in a plan's order never change
as its reader moves, so each (plan, cost class) keeps a max-heap of its hinted entries
on the absolute position of their next use; the order inside one heap is then valid
forever. The entries a plan is expected to read again all have the same expected
distance, so each (plan, cost class) keeps them in its own copy of the fallback policy.
Only the comparison between heaps and groups needs the readers' current positions, and
there are few (jobs x cost classes x 2). An entry is filed under the plan of its nearest
use when it is admitted or read; that can go stale as readers move at different speeds,
but a filing only ever over-states an entry's distance, so the candidate picked is
re-checked and filed again if its nearest use changed. A min-heap per (plan, cost class)
finds the entries whose filed position the reader has passed without the entry being
referenced (the kernel's page cache served the read, or the read was skipped), so they
are filed again too instead of sitting in the window for good. When a plan is added,
replaced, extended or dropped, every entry is filed again: O(entries) once per epoch
per job (about 1 s per 100,000 entries). Every copy of the fallback policy is kept in
step with the first one, which sees every reference, through `export`/`restore`: an
entry keeps its history wherever it is filed.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Protocol

from .eviction import EvictionPolicy
from .scheduler import Plan

__all__ = ["HintedPolicy", "NextUse", "PlanSource"]

DEFAULT_COST_TOLERANCE = 0.5
#: Seconds per byte of a 100 MB/s origin: the cost an unknown cost is taken for.
REFERENCE_COST_PER_BYTE = 1e-8


class PlanSource(Protocol):
    """What `NextUse` reads: `scheduler.PrefetchScheduler` is one."""

    @property
    def plans(self) -> Mapping[Hashable, Plan]: ...

    @property
    def plans_version(self) -> int: ...


def expected_distance(plan: Plan) -> float:
    """Items until `plan`'s reader gets to an object it has read this epoch, if the job
    reads the same files again in a new order: the rest of this epoch, then on average
    half of the next."""
    return plan.remaining + plan.epoch_items / 2


class NextUse:
    """The nearest upcoming use of an object over all plans. Distances are in items of
    each plan's order, counted from its reader's position; a tie between plans goes to
    the plan that was installed first. With `expect_rereads` False, objects a plan has
    read are taken as never read again (no plan expects them)."""

    def __init__(self, source: PlanSource, *, expect_rereads: bool = True) -> None:
        self.source = source
        self.expect_rereads = expect_rereads

    @property
    def version(self) -> int:
        """Changes whenever positions held by a caller may have become stale."""
        return self.source.plans_version

    def nearest(self, key: Hashable,
                plans: list[Plan] | None = None) -> tuple[Plan, int] | None:
        """The plan and the absolute position of the nearest unread use of `key`
        (among `plans`, a copy `upcoming` already made; else the plans now)."""
        best: tuple[Plan, int] | None = None
        best_distance = 0
        for plan in self.plans() if plans is None else plans:
            position = plan.next_position(key)
            if position is None:
                continue
            distance = position - plan.position
            if best is None or distance < best_distance:
                best, best_distance = (plan, position), distance
        return best

    def upcoming(self, key: Hashable) -> tuple[Plan, int | None] | None:
        """`nearest(key)` if some plan has an unread use of `key`; else the plan that is
        expected to read it again soonest, with None for the position; else None."""
        plans = self.plans()  # one copy for both passes
        found = self.nearest(key, plans)
        if found is not None or not self.expect_rereads:
            return found
        best: Plan | None = None
        best_distance = 0.0
        for plan in plans:
            if key in plan:
                distance = expected_distance(plan)
                if best is None or distance < best_distance:
                    best, best_distance = plan, distance
        return None if best is None else (best, None)

    def next_use(self, key: Hashable) -> float | None:
        """Items until the next read of `key` (expected, if its plans have read it);
        None if no plan reads it."""
        found = self.upcoming(key)
        if found is None:
            return None
        plan, position = found
        return expected_distance(plan) if position is None else position - plan.position

    def in_window(self, key: Hashable) -> bool:
        """Whether the nearest hinted read of `key` is within its reader's window."""
        found = self.nearest(key)
        return found is not None and found[0].in_window(found[1])

    def distance(self, key: Hashable) -> tuple[bool, float] | None:
        """(outside every reader's window, items until the next use) for `key`, None if
        no plan reads it: what the SSD tier ranks its candidates by (cache/hinted_victims.py).
        Callable from the SSD tier's worker threads: it only reads the plans, which the
        trio thread changes meanwhile, and an answer made stale by that only costs a
        worse eviction choice."""
        found = self.upcoming(key)
        if found is None:
            return None
        plan, position = found
        if position is None:
            return True, float(expected_distance(plan))
        return not plan.in_window(position), float(position - plan.position)

    def plans(self) -> list[Plan]:
        """The plans now (a copy made in one C call: another thread may add or drop a
        plan meanwhile)."""
        return list(self.source.plans.values())


def _identity(entry: Hashable) -> Hashable:
    return entry


class _Filing:
    """Where an entry with a future is filed: the plan of its next use, the position of
    that use (None: expected to be read again, in the plan's group), its cost class."""

    __slots__ = ("cost_class", "plan", "position", "seq")

    def __init__(self, plan: Plan, position: int | None, cost_class: int, seq: int) -> None:
        self.plan = plan
        self.position = position
        self.cost_class = cost_class
        self.seq = seq  # the seq of its one valid heap record


class _Entry:
    __slots__ = ("cost", "cost_class", "size")

    def __init__(self, size: int, cost: float, cost_class: int) -> None:
        self.size = size
        self.cost = cost
        self.cost_class = cost_class


# A heap record: (-position of the next use, seq, entry); seq is unique, so entries are
# never compared, and a record is current iff its seq is the entry's.
_Record = tuple[int, int, Hashable]
_Group = tuple[Plan, int]  # (plan, cost class)


class HintedPolicy(EvictionPolicy):
    """Farthest next use first (weighted by refetch cost per byte), entries with no
    hinted future before that in `fallback`'s order, entries in a reader's window last.
    See the module docstring. `fallback` must be empty; the policy owns it."""

    def __init__(self, fallback: EvictionPolicy, next_use: NextUse, *,
                 key_of: Callable[[Hashable], Hashable] = _identity,
                 cost_tolerance: float = DEFAULT_COST_TOLERANCE,
                 reference_cost_per_byte: float = REFERENCE_COST_PER_BYTE) -> None:
        if len(fallback):
            raise ValueError("the fallback policy must be empty")
        if cost_tolerance <= 0 or reference_cost_per_byte <= 0:
            raise ValueError("cost_tolerance and reference_cost_per_byte must be > 0")
        self.next_use = next_use
        self.key_of = key_of
        self.cost_tolerance = cost_tolerance
        self.reference_cost_per_byte = reference_cost_per_byte
        self._class_width = math.log1p(cost_tolerance)
        self._template = copy.deepcopy(fallback)  # an empty copy, for new groups
        self._all = fallback  # every entry and every reference: the history
        self._unhinted = copy.deepcopy(fallback)  # entries with no hinted future
        self._entries: dict[Hashable, _Entry] = {}
        self._filed: dict[Hashable, _Filing] = {}  # entries with a future
        self._heaps: dict[_Group, list[_Record]] = {}  # hinted, farthest on top
        self._behind: dict[_Group, list[_Record]] = {}  # the same, nearest on top
        self._groups: dict[_Group, EvictionPolicy] = {}  # expected to be read again
        # Entries referenced since their state was copied into their group: refreshed
        # only when the group picks one as its victim (see _fresh).
        self._stale: set[Hashable] = set()
        # Entries admitted or referenced and not filed since (see _file_later).
        self._unfiled: dict[Hashable, None] = {}
        # With no plan at all, entries whose copy in `_unhinted` is out of date: the
        # full history alone is the fallback policy then (see _file_later).
        self._plain: dict[Hashable, None] = {}
        self._records = 0
        self._seq = 0
        self._version = next_use.version

    # -- EvictionPolicy ---------------------------------------------------------------
    def admit(self, key: Hashable, size: int, cost: float) -> None:
        self._sync()
        self._all.admit(key, size, cost)
        self._set_entry(key, size, cost)
        self._file_later(key)

    def touch(self, key: Hashable) -> None:
        if key not in self._entries:
            return
        self._sync()
        self._all.touch(key)
        self._file_later(key)

    def remove(self, key: Hashable) -> None:
        if self._entries.pop(key, None) is None:
            return
        self._all.remove(key)
        self._unhinted.remove(key)
        self._stale.discard(key)
        self._unfiled.pop(key, None)
        self._plain.pop(key, None)
        filing = self._filed.pop(key, None)  # a heap record is now outdated
        if filing is not None and filing.position is None:
            self._groups[filing.plan, filing.cost_class].remove(key)

    def victim(self) -> Hashable | None:
        self._sync()
        if not self.next_use.source.plans:
            return self._all.victim()  # no plan: the fallback's own choice
        self._file_unfiled()
        self._file_passed()
        self._unhinted.restore_clock(self._all.export_clock())
        key = self._unhinted.victim()
        if key is not None:
            return key
        while True:
            key = self._farthest()
            if key is None:
                return None
            filing = self._filed[key]
            found = self.next_use.upcoming(self.key_of(key))
            if found is not None and found[0] is filing.plan and found[1] == filing.position:
                return key
            self._file(key, referenced=False)  # its next use moved: file it again
            if key in self._unhinted:
                return key

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def export(self, key: Hashable) -> tuple[float, ...]:
        return self._all.export(key)

    def restore(self, key: Hashable, size: int, cost: float, state: tuple[float, ...]) -> None:
        self._sync()
        self._all.restore(key, size, cost, state)
        self._set_entry(key, size, cost)
        self._file_later(key)

    @property
    def clock(self) -> int:
        return self._all.clock

    def export_clock(self) -> float:
        return self._all.export_clock()

    def restore_clock(self, value: float) -> None:
        self._all.restore_clock(value)

    # -- introspection ----------------------------------------------------------------
    def hinted(self, key: Hashable) -> bool:
        """Whether `key` is ranked by its future (else by the fallback alone)."""
        self._sync()
        self._file_unfiled()
        return key in self._filed

    # -- internals --------------------------------------------------------------------
    def _cost_class(self, size: int, cost: float) -> int:
        if cost <= 0 or size <= 0:
            return 0  # unknown: the reference cost
        ratio = cost / size / self.reference_cost_per_byte
        return round(math.log(ratio) / self._class_width)

    def _set_entry(self, key: Hashable, size: int, cost: float) -> None:
        cost_class = self._cost_class(size, cost)
        filing = self._filed.get(key)
        if filing is not None and filing.cost_class != cost_class:
            self._leave(key, filing)  # it moves to another heap or group
        self._entries[key] = _Entry(size, cost, cost_class)

    def _weight(self, cost_class: int) -> float:
        return (1.0 + self.cost_tolerance) ** cost_class

    def _file(self, key: Hashable, *, referenced: bool, push: bool = True) -> None:
        """Put `key` where its next use says: a heap, a group, or the fallback's copy.
        `referenced`: the entry's history changed, so a copy holding it is refreshed.
        `push` False: leave the heaps to a `_compact` that follows."""
        found = self.next_use.upcoming(self.key_of(key))
        filing = self._filed.get(key)
        if found is None:
            if filing is not None:
                self._leave(key, filing)
            if referenced or key not in self._unhinted:
                # Kept exact: without hints this is the configured policy, decision for
                # decision (a lazy copy would see other global stats, e.g. cost-lrfu's).
                self._copy_into(self._unhinted, key)
            return
        plan, position = found
        if key in self._unhinted:
            self._unhinted.remove(key)
            self._stale.discard(key)
        if filing is not None and filing.plan is plan and filing.position == position:
            if position is None and referenced:
                self._stale.add(key)
            return
        if filing is not None:
            self._leave(key, filing)
        cost_class = self._entries[key].cost_class
        self._seq += 1
        self._filed[key] = _Filing(plan, position, cost_class, self._seq)
        if position is None:
            group = self._groups.get((plan, cost_class))
            if group is None:
                group = self._groups[plan, cost_class] = copy.deepcopy(self._template)
            self._copy_into(group, key)
            return
        if not push:
            return
        group_id = (plan, cost_class)
        heapq.heappush(self._heaps.setdefault(group_id, []), (-position, self._seq, key))
        heapq.heappush(self._behind.setdefault(group_id, []), (position, self._seq, key))
        self._records += 2
        if self._records > 4 * len(self._filed) + 1024:
            self._compact()

    def _file_later(self, key: Hashable) -> None:
        """File `key` when a victim is next wanted, not now: a RAM tier that holds what
        the readers read (a warm epoch) never evicts, and then never pays for filing;
        one that evicts files each entry once per victim instead of once per hit. With
        no plan at all nothing is filed: the full history is then the fallback policy,
        decision for decision, and victims come from it; the entries' copies in
        `_unhinted` are brought up to date when a plan arrives (`_sync`)."""
        if self.next_use.source.plans:
            self._unfiled[key] = None
        else:
            self._plain[key] = None

    def _file_unfiled(self) -> None:
        for key in self._unfiled:
            self._file(key, referenced=True)
        self._unfiled.clear()

    def _leave(self, key: Hashable, filing: _Filing) -> None:
        del self._filed[key]  # a heap record is now outdated
        if filing.position is None:
            self._groups[filing.plan, filing.cost_class].remove(key)
            self._stale.discard(key)

    def _copy_into(self, policy: EvictionPolicy, key: Hashable) -> None:
        """Copy the entry's state from the full history into one of the copies."""
        entry = self._entries[key]
        policy.restore_clock(self._all.export_clock())
        policy.restore(key, entry.size, entry.cost, self._all.export(key))
        self._stale.discard(key)

    def _fresh(self, policy: EvictionPolicy) -> Hashable | None:
        """A group's victim, its state brought up to date first. A hit raises an
        entry's own rank (more recent, more frequent), so an entry whose copy is out of
        date looks like a better victim than it is: the copy is refreshed when it is
        picked, and the pick made again. This keeps a RAM hit on a file a plan has read
        at one update of the full history instead of two. Within a group the order can
        differ from an eager copy's where a policy ranks by global statistics too
        (cost-lrfu's staleness horizon): entries there all wait for the same epoch, so
        that order is a tie-break."""
        while True:
            key = policy.victim()
            if key is None or key not in self._stale:
                return key
            self._copy_into(policy, key)

    def _file_passed(self) -> None:
        """File again the hinted entries whose position the reader has passed."""
        for group_id, heap in list(self._behind.items()):
            plan = group_id[0]
            while self._valid_top(heap) and heap[0][0] < plan.position:
                key = heapq.heappop(heap)[2]
                self._records -= 1
                self._file(key, referenced=False)
            if not heap:
                del self._behind[group_id]

    def _farthest(self) -> Hashable | None:
        """The best candidate over the heaps' tops and the groups' victims: outside the
        window first, then the largest weighted distance. Ties go to heaps, then to the
        heap or group created first."""
        best: Hashable | None = None
        best_rank: tuple[bool, float] | None = None
        for group_id, heap in list(self._heaps.items()):
            if not self._valid_top(heap):
                del self._heaps[group_id]
                continue
            plan, cost_class = group_id
            position = -heap[0][0]
            rank = (position >= plan.frontier,
                    (position - plan.position) / self._weight(cost_class))
            if best_rank is None or rank > best_rank:
                best, best_rank = heap[0][2], rank
        clock = self._all.export_clock()
        for group_id, group in list(self._groups.items()):
            group.restore_clock(clock)
            key = self._fresh(group)
            if key is None:
                del self._groups[group_id]
                continue
            plan, cost_class = group_id
            rank = (True, expected_distance(plan) / self._weight(cost_class))
            if best_rank is None or rank > best_rank:
                best, best_rank = key, rank
        return best

    def _valid_top(self, heap: list[_Record]) -> bool:
        filed = self._filed
        while heap:
            _, seq, key = heap[0]
            filing = filed.get(key)
            if filing is not None and filing.seq == seq:
                return True
            heapq.heappop(heap)
            self._records -= 1
        return False

    def _compact(self) -> None:
        # Outdated records cost memory only; dropping them when they outnumber the live
        # ones keeps the heaps O(n) at an amortised O(1) per operation.
        heaps: dict[_Group, list[_Record]] = {}
        behind: dict[_Group, list[_Record]] = {}
        for key, filing in self._filed.items():
            if filing.position is not None:
                group_id = (filing.plan, filing.cost_class)
                heaps.setdefault(group_id, []).append((-filing.position, filing.seq, key))
                behind.setdefault(group_id, []).append((filing.position, filing.seq, key))
        for heap in (*heaps.values(), *behind.values()):
            heapq.heapify(heap)
        self._heaps, self._behind = heaps, behind
        self._records = 2 * sum(map(len, heaps.values()))

    def _sync(self) -> None:
        """After any plan change every entry is filed again (positions of a replaced
        plan mean nothing; a new plan gives entries with no future one)."""
        version = self.next_use.version
        if version == self._version:
            return
        self._version = version
        # Filings under plans that are gone are dropped wholesale, groups and all.
        live = set(self.next_use.source.plans.values())
        for group_id in [g for g in self._groups if g[0] not in live]:
            del self._groups[group_id]
        for key in [k for k, filing in self._filed.items() if filing.plan not in live]:
            del self._filed[key]
        for key in self._entries:
            self._file(key, referenced=key in self._unfiled or key in self._plain,
                       push=False)
        self._unfiled.clear()
        self._plain.clear()
        self._compact()
