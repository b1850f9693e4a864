"""Which cache entry to evict next: LRU, LFU, LRFU and DLCache's cost-aware LRFU.

One policy object ranks the entries of one cache tier; the RAM and the SSD tier each own
an instance of the same class. The policy holds no bytes and makes no calls: the tier
tells it what happened (`admit`, `touch`, `remove`) and asks for `victim()` when it needs
room, then calls `remove()` for what it actually dropped.

Time is logical: the policy's clock counts references (every `admit` and `touch`), so a
replayed trace gives the same decisions however fast it is replayed, and an entry's
state can be saved in the cache index and restored after a restart (`export`/`restore`,
`export_clock`/`restore_clock`). A second clock counts misses (every `admit`): cost-lrfu
measures staleness on it (below).

Cool-down (DLCache): an entry admitted within the last `cooldown` references is not
evicted while any entry outside its cool-down exists, so bytes that a prefetch just
brought in survive until the reader gets to them. When every entry is cooling, the
lowest-ranked one goes anyway: the tier must keep to its byte budget.

LRFU (Lee et al., as used by DLCache): an entry's combined recency and frequency is
CRF_t = sum over its past references t_i of F(t - t_i), F(x) = (1/p)^(lam * x). At a
reference CRF becomes 1 + CRF_last * F(t - t_last). Because F is exponential, every
CRF decays by the same factor as time passes, so the order of entries only changes
when one of them is referenced: the key ln(CRF_last) + lam * ln(p) * t_last is
time-invariant. Entries sit in a heap on that key and outdated heap records are
skipped (lazy invalidation), so every operation is O(log n) amortised with no scans.
lam = 0 is LFU; lam * log2(p) >= 1 is LRU (the latest reference outweighs all older
ones together). What matters is the half-life of a reference, 1 / (lam * log2(p))
references (`lam_for_half_life`).

Cost-aware LRFU (DLCache), `cost-lrfu`, ranks in this order:
1. Entries no active job reads go first. DLCache knows which jobs use a block; the
   tier does not, so an entry counts as abandoned when it has not been referenced for
   more than `stale_after` times the mean gap between two references to one entry
   (over the entries in the tier that were referenced twice). In shuffled epochs that
   gap is at most two epochs and one on average, so 3 gaps means nobody is reading it;
   abandoned entries go least recent first. This is what lets a finished job's dataset
   drain away, at any dataset size, without a decay rate tuned to it. Gaps and ages
   are counted in misses, not references: while the tier serves its readers well,
   little of its content needs replacing and staleness advances slowly; when a new
   dataset starts (every read a miss), the old one goes stale within about one epoch
   of the new one. Counted in references it took three epochs, and on a job switch
   cost-lrfu fell up to 22 points of hit ratio below LRU (see docs/BENCHMARKS.md).
2. Lowest CRF first. CRFs are almost never exactly equal, so "tie" is defined on a log
   scale: the same integer part of log_(1+tolerance) CRF (taken on the time-invariant
   key, so it is time-invariant too); tied CRFs are within a factor 1 + tolerance.
   CRF estimates how often an entry will be read from a handful of reads, and in
   shuffled training most of the spread between CRFs is where in each permutation the
   reads happened to fall, which predicts nothing. `tolerance = 0` is the paper's rule
   to the letter (exact ties only).
3. Among tied CRFs, the lowest refetch cost *per byte* (eviction frees bytes: one 1 MB
   entry frees as much as ten 100 KB ones); costs per byte in the same log bucket of
   ratio 1 + `cost_tolerance` are equal, so measurement noise does not decide. A cost of
   0 means "unknown" and ranks as cheapest.
4. Among entries equal on all of that, the most recently referenced. In epoch-based
   training the entry just read is the one not needed again until the next epoch,
   while one not read for a while is due: evicting the newest keeps a stable set in the
   tier across shuffled epochs, where LRU evicts each entry just before it is needed
   (at half the working set, 5 shuffled epochs: LRU hits 12% of reads, this 39%,
   Belady's MIN 40%).

Defaults (tuned with `python -m bench.simulate`; the figures are in docs/BENCHMARKS.md):
  p = 2, lam = 2**-24: a half-life of 16.8M references. Decay fades popularity over
      the long run; it must not act within a few epochs, or entries read in an older
      window of half_life * log2(1 + tolerance) references rank below newer ones and the
      tier churns like LRU on shuffled epochs (as it does once the half-life is below
      about two epochs' worth of references). Staleness (1.) does the fast adapting.
  stale_after = 3 (mean gaps). 2 turns the policy into LRU on sampled (with
      replacement) workloads; 4 holds a finished job's data for longer.
  cooldown = 64 references: a few batches of read-ahead. Costs a little hit ratio when
      nothing is prefetched (the simulator), protects prefetched bytes when something is.
  tolerance = 1.0: CRFs within a factor of two tie (log2 buckets of reference counts).
  cost_tolerance = 0.5: costs per byte within a factor of 1.5 are equal; origins 2x
      apart stay apart.
`lru`, `lfu` and `lrfu` are the textbook policies (with the cool-down), for comparison.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable

__all__ = [
    "DEFAULT_POLICY",
    "LFU",
    "LRFU",
    "LRU",
    "POLICIES",
    "CostAwareLRFU",
    "EntryState",
    "EvictionPolicy",
    "RankedPolicy",
    "lam_for_half_life",
    "make_policy",
]

DEFAULT_COOLDOWN = 64
DEFAULT_P = 2.0
DEFAULT_LAM = 2.0**-24
DEFAULT_TOLERANCE = 1.0
DEFAULT_COST_TOLERANCE = 0.5
DEFAULT_STALE_AFTER = 3.0


class EvictionPolicy(ABC):
    """The interface a cache tier uses. Keys are opaque and never compared."""

    @abstractmethod
    def admit(self, key: Hashable, size: int, cost: float) -> None:
        """`key` was inserted (a reference). `cost`: seconds to fetch it again, 0 if
        unknown. Admitting a key already present counts as a reference, takes the new
        size and cost and restarts its cool-down."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """A hit on `key` (a reference). Unknown keys are ignored."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """`key` left the tier (evicted, invalidated, demoted). Unknown keys are ignored."""

    @abstractmethod
    def victim(self) -> Hashable | None:
        """The entry to evict next, without removing it; None when empty."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def export(self, key: Hashable) -> tuple[float, ...]:
        """The entry's eviction state, to be stored next to it in the index: a few
        numbers, opaque to the caller (today: admitted, last reference, count or CRF,
        gap between its last two references, miss clock at the last reference). Raises
        KeyError for an unknown key."""

    @abstractmethod
    def restore(self, key: Hashable, size: int, cost: float, state: tuple[float, ...]) -> None:
        """Put back an entry saved by `export` (not a reference: the clock does not tick)."""

    @property
    @abstractmethod
    def clock(self) -> int:
        """References seen so far (the policy's logical time)."""

    def export_clock(self) -> tuple[float, ...]:
        """The policy's clocks, for `restore_clock`."""
        return (float(self.clock),)

    @abstractmethod
    def restore_clock(self, value: float | tuple[float, ...]) -> None:
        """Set the clocks from `export_clock` (or the reference clock alone); they never
        go backwards."""


class EntryState:
    """One entry's eviction state: what `export` saves and every rank is computed from."""

    __slots__ = ("admitted", "cooling", "cost", "gap", "last", "last_miss", "score", "seq",
                 "size")

    def __init__(self, size: int, cost: float, admitted: int, misses: int = 0) -> None:
        self.size = size
        self.cost = cost
        self.admitted = admitted
        self.last = admitted
        self.last_miss = misses  # the miss clock at its last reference
        self.gap = 0  # 1 + misses between its last two references; 0: referenced once
        self.score = 0.0  # count (LFU) or CRF at `last` (LRFU); unused by LRU
        self.cooling = False
        self.seq = 0  # the seq of this entry's valid heap records


# A heap record: (rank, seq, key). The rank is a tuple of numbers computed from the
# entry's saved state only, so a restored policy orders entries exactly as the original
# did; seq is unique, so keys are never compared, and a record is current iff its seq is
# the entry's.
_Record = tuple[tuple[float, ...], int, Hashable]


class RankedPolicy(EvictionPolicy):
    """Heap machinery shared by the policies. Subclasses say how a reference changes an
    entry's score (`_first`, `_again`) and how entries are ranked (`_rank`, lowest is
    evicted first). With `stale_after` > 0 (cost-lrfu), an entry out of cool-down that
    has not been referenced for more than `stale_after` times the mean gap between
    references (over the entries in the tier) goes first, least recent first, whatever
    its rank."""

    #: Off unless a subclass sets it before the first entry arrives.
    stale_after: float = 0.0

    def __init__(self, *, cooldown: int = DEFAULT_COOLDOWN) -> None:
        if cooldown < 0:
            raise ValueError("cooldown must be >= 0")
        self.cooldown = int(cooldown)
        self._clock = 0
        self._misses = 0
        self._seq = 0
        self._entries: dict[Hashable, EntryState] = {}
        self._ready: list[_Record] = []  # entries out of cool-down
        # (admitted, seq, key) of the entries in cool-down, by when it ends. They are not
        # ranked as they come: each is when its cool-down ends, or by the rare victim()
        # that finds every entry cooling, when at most `cooldown` are (each admission
        # moves the clock).
        self._ends: list[tuple[int, int, Hashable]] = []
        # ((last miss, last), seq, key), out of cool-down: staleness order.
        self._recency: list[tuple[tuple[int, int], int, Hashable]] = []
        # Gaps of the entries in the tier that were referenced more than once. Integers,
        # so a restored policy computes exactly the same mean.
        self._gap_sum = 0
        self._gap_count = 0
        # Entries admitted or referenced since their last heap record: ranked and
        # pushed when a victim is next wanted (`_push_pending`), not at every admission
        # or hit. A tier that never evicts (a warm epoch from RAM, a cold one filling
        # the tier) then never ranks its entries until it must, and one that does ranks
        # an entry once per victim at most. Every rank ends in the entry's last
        # reference, unique, so the order of pushes never decides a victim.
        self._unpushed: dict[Hashable, None] = {}

    # -- subclass hooks ---------------------------------------------------------------
    def _first(self, entry: EntryState) -> None:
        """First reference (admit); `entry.last` is already the current time."""

    def _again(self, entry: EntryState, now: int) -> None:
        """Another reference at `now`; `entry.last` still holds the previous one."""

    @abstractmethod
    def _rank(self, entry: EntryState) -> tuple[float, ...]: ...

    # -- interface --------------------------------------------------------------------
    @property
    def clock(self) -> int:
        return self._clock

    @property
    def misses(self) -> int:
        """Admissions seen so far (the clock staleness is measured on)."""
        return self._misses

    def export_clock(self) -> tuple[float, ...]:
        return (float(self._clock), float(self._misses))

    def restore_clock(self, value: float | tuple[float, ...]) -> None:
        clock, misses = (value, 0) if isinstance(value, int | float) else (*value, 0)[:2]
        self._clock = max(self._clock, int(clock))
        self._misses = max(self._misses, int(misses))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def admit(self, key: Hashable, size: int, cost: float) -> None:
        self._clock += 1
        self._misses += 1
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self.new_state(size, cost, self._clock, self._misses)
        else:
            self._reference(entry)
            entry.size, entry.cost, entry.admitted = size, cost, self._clock
        self._start_cooldown(key, entry)
        if entry.cooling:
            self._unpushed.pop(key, None)  # ranked when its cool-down ends
        else:
            self._unpushed[key] = None
        self._maybe_rebuild()

    def touch(self, key: Hashable) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        self._clock += 1
        self._reference(entry)
        if not entry.cooling:  # else ranked when its cool-down ends
            self._unpushed[key] = None

    def remove(self, key: Hashable) -> None:
        # Its heap records are now outdated: dropped when they surface or at a rebuild,
        # which the next admission or victim decides on (a removal adds no record).
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._unpushed.pop(key, None)
            self._count_gap(entry, -1)

    def victim(self) -> Hashable | None:
        if self._unpushed:
            self._push_pending()
        self._end_cooldowns()
        if self.stale_after > 0 and self._gap_count:
            key = self._top(self._recency)
            horizon = self._misses - self.stale_after * self._gap_sum / self._gap_count
            if key is not None and self._entries[key].last_miss < horizon:
                return key
        key = self._top(self._ready)
        return key if key is not None else self._first_cooling()

    def export(self, key: Hashable) -> tuple[float, ...]:
        return self.saved(self._entries[key])

    def restore(self, key: Hashable, size: int, cost: float, state: tuple[float, ...]) -> None:
        self.remove(key)
        entry = self._entries[key] = self.state_from(size, cost, state)
        self._count_gap(entry, 1)
        # A later reference must come after every restored one.
        self._clock = max(self._clock, entry.admitted, entry.last)
        self._misses = max(self._misses, entry.last_miss)
        self._start_cooldown(key, entry)
        if not entry.cooling:  # else ranked when its cool-down ends
            self._push(key, entry)  # `remove` above took it out of the pending ones
        self._maybe_rebuild()

    # -- the math alone, for a tier that keeps the order itself (the SSD tier keeps it
    # -- as index keys: bucketfs/cache/ranking.py) --------------------------------------
    def new_state(self, size: int, cost: float, now: int, misses: int) -> EntryState:
        """The state of an entry admitted at `now`, when the miss clock reads `misses`
        (does not touch this policy's heaps)."""
        state = EntryState(size, cost, now, misses)
        self._first(state)
        return state

    def state_from(self, size: int, cost: float, saved: tuple[float, ...]) -> EntryState:
        """The state `export` saved (another policy's numbers are taken as they are)."""
        admitted, last, score, *rest = saved
        state = EntryState(size, cost, int(admitted))
        state.last = int(last)
        state.score = float(score)
        state.gap = int(rest[0]) if rest else 0
        state.last_miss = int(rest[1]) if len(rest) > 1 else 0
        return state

    @staticmethod
    def saved(state: EntryState) -> tuple[float, ...]:
        return (float(state.admitted), float(state.last), float(state.score),
                float(state.gap), float(state.last_miss))

    def reference_state(self, state: EntryState, now: int, misses: int) -> None:
        """A reference to the entry at `now` (miss clock `misses`): its score, gap and
        last reference move."""
        self._again(state, now)
        state.gap = misses - state.last_miss + 1
        state.last = now
        state.last_miss = misses

    def identity(self) -> str:
        """The policy and its parameters: ranks saved under another identity are stale."""
        params = sorted((k, v) for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}{params}"

    def rank(self, state: EntryState) -> tuple[float, ...]:
        """Lowest is evicted first. Depends on the entry's own state only, never on the
        clock: an order kept elsewhere stays valid until the entry is referenced."""
        return self._rank(state)

    # -- heap machinery ---------------------------------------------------------------
    def _reference(self, entry: EntryState) -> None:
        self._count_gap(entry, -1)
        self.reference_state(entry, self._clock, self._misses)
        self._count_gap(entry, 1)

    def _count_gap(self, entry: EntryState, sign: int) -> None:
        if entry.gap:
            self._gap_sum += sign * entry.gap
            self._gap_count += sign

    def _start_cooldown(self, key: Hashable, entry: EntryState) -> None:
        # Whether the cool-down is over is decided lazily in victim(): nothing else
        # depends on it, and the clock may still be restored.
        entry.cooling = self.cooldown > 0
        if entry.cooling:
            self._seq += 1
            entry.seq = self._seq  # outdates its records in the other heaps
            heapq.heappush(self._ends, (entry.admitted, self._seq, key))

    def _push_pending(self) -> None:
        pending = self._unpushed
        if 2 * len(pending) > len(self._entries):
            # Most entries were referenced (a warm epoch, then a miss): one rebuild ranks
            # each once and leaves no outdated record, where pushes would leave one each.
            self._rebuild()
            return
        entries = self._entries
        for key in pending:
            self._push(key, entries[key])  # `remove` takes a key out of both
        pending.clear()
        self._maybe_rebuild()

    def _push(self, key: Hashable, entry: EntryState) -> None:
        """Heap an entry out of cool-down (one in it is never pending: `admit` and
        `touch` leave it out, and its cool-down's end pushes it)."""
        self._seq += 1
        entry.seq = self._seq  # outdates the entry's earlier records
        heapq.heappush(self._ready, (self._rank(entry), self._seq, key))
        if self.stale_after > 0:
            heapq.heappush(self._recency, ((entry.last_miss, entry.last), self._seq, key))

    def _end_cooldowns(self) -> None:
        ends, entries = self._ends, self._entries
        horizon = self._clock - self.cooldown
        while ends and ends[0][0] <= horizon:
            admitted, _, key = heapq.heappop(ends)
            entry = entries.get(key)
            if entry is not None and entry.cooling and entry.admitted == admitted:
                entry.cooling = False
                self._push(key, entry)

    def _first_cooling(self) -> Hashable | None:
        """The lowest-ranked entry still in cool-down (every entry is): the heap of
        cool-down ends holds each once, with outdated records of removed ones."""
        entries, best, best_rank = self._entries, None, None
        for admitted, _, key in self._ends:
            entry = entries.get(key)
            if entry is None or not entry.cooling or entry.admitted != admitted:
                continue
            rank = self._rank(entry)
            if best_rank is None or rank < best_rank:
                best, best_rank = key, rank
        return best

    def _top(self, heap: list) -> Hashable | None:
        entries = self._entries
        while heap:
            _, seq, key = heap[0]
            entry = entries.get(key)
            if entry is not None and entry.seq == seq:
                return key
            heapq.heappop(heap)
        return None

    def _records(self) -> int:
        return len(self._ready) + len(self._ends) + len(self._recency)

    def _maybe_rebuild(self) -> None:
        # Outdated records cost memory only; rebuilding when they outnumber the live ones
        # (one or two per entry) keeps the heaps O(n) at an amortised O(1) per operation.
        live = 2 if self.stale_after > 0 else 1
        if self._records() > 2 * live * len(self._entries) + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        ready: list[_Record] = []
        ends: list[tuple[int, int, Hashable]] = []
        recency: list[tuple[tuple[int, int], int, Hashable]] = []
        stale = self.stale_after > 0
        for key, entry in self._entries.items():
            self._seq += 1
            entry.seq = self._seq
            if entry.cooling:
                ends.append((entry.admitted, self._seq, key))
            else:
                ready.append((self._rank(entry), self._seq, key))
                if stale:
                    recency.append(((entry.last_miss, entry.last), self._seq, key))
        for heap in (ready, ends, recency):
            heapq.heapify(heap)
        self._ready, self._ends, self._recency = ready, ends, recency
        self._unpushed.clear()  # every entry has its record now


class LRU(RankedPolicy):
    """Least recently used first."""

    def _rank(self, entry: EntryState) -> tuple[float, ...]:
        return (entry.last,)


class LFU(RankedPolicy):
    """Fewest references while in this tier first; among equal counts, least recent."""

    def _first(self, entry: EntryState) -> None:
        entry.score = 1.0

    def _again(self, entry: EntryState, now: int) -> None:
        entry.score += 1.0

    def _rank(self, entry: EntryState) -> tuple[float, ...]:
        return (entry.score, entry.last)


class LRFU(RankedPolicy):
    """Lowest CRF first; among equal CRFs, least recent."""

    def __init__(self, *, p: float = DEFAULT_P, lam: float = DEFAULT_LAM,
                 cooldown: int = DEFAULT_COOLDOWN) -> None:
        super().__init__(cooldown=cooldown)
        if p < 1 or lam < 0:
            raise ValueError("need p >= 1 and lam >= 0")
        self.p = p
        self.lam = lam
        self._decay = lam * math.log(p)  # ln F(x) = -decay * x

    def _first(self, entry: EntryState) -> None:
        entry.score = 1.0

    def _again(self, entry: EntryState, now: int) -> None:
        entry.score = 1.0 + entry.score * math.exp(-self._decay * (now - entry.last))

    def _key(self, entry: EntryState) -> float:
        # ln CRF_t = key - decay * t for every entry, so ordering by key is ordering by
        # CRF at any common time t.
        return math.log(entry.score) + self._decay * entry.last

    def _rank(self, entry: EntryState) -> tuple[float, ...]:
        return (self._key(entry), entry.last)


class CostAwareLRFU(LRFU):
    """DLCache's rule: entries nobody reads any more first (`stale_after` mean gaps
    without a reference); then lowest CRF, where CRFs in the same log bucket of ratio
    1 + `tolerance` tie; among ties the entry cheapest to fetch again per byte (costs in
    the same log bucket of ratio 1 + `cost_tolerance` are equal); among those the most
    recently referenced. See the module docstring for why."""

    def __init__(self, *, p: float = DEFAULT_P, lam: float = DEFAULT_LAM,
                 cooldown: int = DEFAULT_COOLDOWN, tolerance: float = DEFAULT_TOLERANCE,
                 cost_tolerance: float = DEFAULT_COST_TOLERANCE,
                 stale_after: float = DEFAULT_STALE_AFTER) -> None:
        super().__init__(p=p, lam=lam, cooldown=cooldown)
        if tolerance < 0 or cost_tolerance < 0 or stale_after < 0:
            raise ValueError("tolerances and stale_after must be >= 0")
        self.stale_after = stale_after
        self.tolerance = tolerance
        self.cost_tolerance = cost_tolerance
        self._width = math.log1p(tolerance)
        self._cost_width = math.log1p(cost_tolerance)

    def _rank(self, entry: EntryState) -> tuple[float, ...]:
        key = self._key(entry)
        crf = math.floor(key / self._width) if self._width > 0 else key
        per_byte = entry.cost / max(entry.size, 1)
        if per_byte <= 0:
            cost = -math.inf  # unknown: cheapest
        elif self._cost_width > 0:
            cost = math.floor(math.log(per_byte) / self._cost_width)
        else:
            cost = per_byte
        # Most recent first among full ties: see the module docstring.
        return (crf, cost, -entry.last)


POLICIES: dict[str, type[RankedPolicy]] = {
    "lru": LRU,
    "lfu": LFU,
    "lrfu": LRFU,
    "cost-lrfu": CostAwareLRFU,
}
DEFAULT_POLICY = "cost-lrfu"


def lam_for_half_life(references: float, p: float = DEFAULT_P) -> float:
    """The `lam` under which a reference's weight halves every `references` references."""
    if references <= 0 or p <= 1:
        raise ValueError("need references > 0 and p > 1")
    return 1.0 / (references * math.log2(p))


def make_policy(name: str = DEFAULT_POLICY, **params: float) -> RankedPolicy:
    """A policy by name (`lru`, `lfu`, `lrfu`, `cost-lrfu`) with keyword parameters:
    `cooldown` for all, `p` and `lam` for the LRFUs, `tolerance`, `cost_tolerance` and
    `stale_after` for cost-lrfu."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; "
                         f"one of {', '.join(POLICIES)}") from None
    return cls(**params)  # type: ignore[arg-type]
