"""The SSD tier's eviction order, kept as ordered keys in the RocksDB index.

Why: a tier of a million blocks must not cost a million Python objects. A policy ranks
an entry by a tuple computed from that entry's own state alone (`RankedPolicy.rank`:
LRFU's key is time-invariant), so the order only changes for an entry when it is
referenced, and it can live in the index as keys that sort like the ranks (schema.py):
`R` + rank + name, lowest evicted first, and `T` + miss clock + clock + name, for
cost-lrfu's "abandoned" rule. An entry's record (`E`, disk.py), its rank key and its
recency key change together in one WriteBatch, so a crash never leaves them disagreeing.

What stays in Python is small: the clocks (references and misses), the sum and count of
gaps between references (cost-lrfu's staleness horizon) and the entries still in their
cool-down; an entry cools for `cooldown` references after its admission, so at most
`cooldown` entries do; and per prefix a floor that scans start from (see `floors`).

Not thread-safe: the SSD tier calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterator

from rocksdict import Rdict, WriteBatch

from bucketfs.cache.schema import (
    RANK,
    RECENCY,
    RECENCY_WIDTH,
    rank_key,
    rank_key_name,
    recency_key,
    recency_key_miss,
    recency_key_name,
)
from bucketfs.prefetch.eviction import EntryState, RankedPolicy


class IndexRanking:
    def __init__(self, index: Rdict, policy: RankedPolicy) -> None:
        self.index = index
        self.policy = policy
        self.clock = 0
        self.misses = 0
        self.gap_sum = 0
        self.gap_count = 0
        #: entry -> the clock at its admission, for entries still in their cool-down.
        self.cooling: dict[bytes, int] = {}
        self.rank_width = 8 * len(policy.rank(policy.new_state(1, 0.0, 1, 1)))
        #: The index key through which `victim()` last found its entry.
        self.victim_key = b""
        #: Per prefix, a key no live key sorts below: scans start there. Below the
        #: lowest live key lie only deleted ones, and RocksDB steps over deleted keys
        #: one by one until a compaction drops them: with evictions taking the lowest
        #: keys, by the third epoch of a full tier that cost milliseconds per eviction.
        #: A scan raises the floor to the first key it finds; a key written below the
        #: floor lowers it.
        self.floors = {RANK: RANK, RECENCY: RECENCY}

    # --- keys --------------------------------------------------------------------------

    def _rank_key(self, entry: bytes, state: EntryState) -> bytes:
        return rank_key(self.policy.rank(state), entry)

    @staticmethod
    def _recency_key(entry: bytes, state: EntryState) -> bytes:
        return recency_key(state.last_miss, state.last, entry)

    def _put_keys(self, batch: WriteBatch, entry: bytes, state: EntryState) -> None:
        keys = [self._rank_key(entry, state)]
        if self.policy.stale_after > 0:
            keys.append(self._recency_key(entry, state))
        for key in keys:
            batch.put(key, b"")
            prefix = key[:1]
            self.floors[prefix] = min(self.floors[prefix], key)

    def _delete_keys(self, batch: WriteBatch, entry: bytes, state: EntryState) -> None:
        batch.delete(self._rank_key(entry, state))
        if self.policy.stale_after > 0:
            batch.delete(self._recency_key(entry, state))

    def _count_gap(self, state: EntryState, sign: int) -> None:
        if state.gap:
            self.gap_sum += sign * state.gap
            self.gap_count += sign

    # --- what happened (each adds its key changes to the caller's batch) ----------------

    def admitted(self, batch: WriteBatch, entry: bytes, size: int,
                 cost: float) -> tuple[float, ...]:
        """A new entry; returns the state to save in its record."""
        self.clock += 1
        self.misses += 1
        state = self.policy.new_state(size, cost, self.clock, self.misses)
        self._put_keys(batch, entry, state)
        if self.policy.cooldown > 0:
            self.cooling[entry] = self.clock
        return self.policy.saved(state)

    def referenced_later(self, size: int, cost: float,
                         saved: tuple[float, ...]) -> tuple[float, ...]:
        """A hit on an entry in state `saved`: its new state, with no key written yet
        (`moved` writes them, when references.py writes the hits that waited)."""
        self.clock += 1
        state = self.policy.state_from(size, cost, saved)
        self._count_gap(state, -1)
        self.policy.reference_state(state, self.clock, self.misses)
        self._count_gap(state, 1)
        return self.policy.saved(state)

    def moved(self, batch: WriteBatch, entry: bytes, size: int, cost: float,
              old: tuple[float, ...], new: tuple[float, ...]) -> None:
        """An entry's keys go from its state `old` to `new`."""
        self._delete_keys(batch, entry, self.policy.state_from(size, cost, old))
        self._put_keys(batch, entry, self.policy.state_from(size, cost, new))

    def resized(self, batch: WriteBatch, entry: bytes, size: int, cost: float,
                new_size: int, new_cost: float, saved: tuple[float, ...]) -> None:
        """An entry (a chunk that lost members) now counts `new_size` bytes and
        `new_cost`: its keys as that size and cost rank it, its state otherwise kept."""
        self._delete_keys(batch, entry, self.policy.state_from(size, cost, saved))
        self._put_keys(batch, entry, self.policy.state_from(new_size, new_cost, saved))

    def never_moved(self, old: tuple[float, ...], new: tuple[float, ...]) -> None:
        """Hits that took an entry from `old` to `new` were never written, and the entry
        went in state `old` (`removed` counted that state's gap): the gap totals as if
        it had gone in state `new`, as it would have had they been written."""
        self._count_gap(self.policy.state_from(0, 0.0, old), 1)
        self._count_gap(self.policy.state_from(0, 0.0, new), -1)

    def removed(self, batch: WriteBatch, entry: bytes, size: int, cost: float,
                saved: tuple[float, ...]) -> None:
        state = self.policy.state_from(size, cost, saved)
        self._delete_keys(batch, entry, state)
        self._count_gap(state, -1)
        self.cooling.pop(entry, None)

    def restored(self, batch: WriteBatch | None, entry: bytes, size: int, cost: float,
                 saved: tuple[float, ...]) -> None:
        """An entry found at startup (recovery scan): count it, and write its keys when
        they are being rebuilt (`batch` given)."""
        state = self.policy.state_from(size, cost, saved)
        self.clock = max(self.clock, state.admitted, state.last)
        self.misses = max(self.misses, state.last_miss)
        self._count_gap(state, 1)
        if batch is not None:
            self._put_keys(batch, entry, state)

    # --- the decision ------------------------------------------------------------------

    def victim(self) -> bytes | None:
        """The entry to evict next, without removing it; None when there is none."""
        horizon = self.clock - self.policy.cooldown
        for entry in [e for e, at in self.cooling.items() if at <= horizon]:
            del self.cooling[entry]
        if self.policy.stale_after > 0 and self.gap_count:
            key = self._first_not_cooling(RECENCY, fallback=False)
            stale = self.misses - self.policy.stale_after * self.gap_sum / self.gap_count
            if key is not None and recency_key_miss(key) < stale:
                self.victim_key = key
                return recency_key_name(key)
        key = self._first_not_cooling(RANK, fallback=True)
        if key is None:
            return None
        self.victim_key = key
        return rank_key_name(key, self.rank_width)

    def _first_not_cooling(self, prefix: bytes, *, fallback: bool) -> bytes | None:
        """The first key under `prefix` whose entry is not in its cool-down; with
        `fallback`, the first key if all are cooling (the budget must still be kept)."""
        width = RECENCY_WIDTH if prefix == RECENCY else self.rank_width
        first = None
        for key in self._keys(prefix):  # at most len(cooling) keys are skipped
            if key[len(prefix) + width:] not in self.cooling:
                return key
            first = first or key
        return first if fallback else None

    def head(self) -> Iterator[tuple[bytes, bytes]]:
        """(index key, entry) in eviction order: `victim()`'s choice first, then the rank
        order, skipping entries in their cool-down. For hinted eviction
        (hinted_victims.py)."""
        first = self.victim()
        if first is None:
            return
        yield self.victim_key, first
        for key in self._keys(RANK):
            entry = rank_key_name(key, self.rank_width)
            if entry != first and entry not in self.cooling:
                yield key, entry

    def tail(self) -> Iterator[tuple[bytes, bytes]]:
        """(index key, entry) from the other end of the rank order: the entries the
        policy would keep longest (in a hinted epoch, mostly what was just read; the
        cool-down, a guard for entries with no history, does not apply: the future is
        known)."""
        for key in self._keys(RANK, backward=True):
            yield key, rank_key_name(key, self.rank_width)

    def _keys(self, prefix: bytes, *, backward: bool = False) -> Iterator[bytes]:
        """The index keys under `prefix`, in order (or from the last one back)."""
        it = self.index.iter()
        if backward:
            it.seek_for_prev(bytes([prefix[0] + 1]))
        else:
            it.seek(self.floors[prefix])
            if it.valid() and it.key().startswith(prefix):
                self.floors[prefix] = it.key()  # the lowest live key
        while it.valid() and (key := it.key()).startswith(prefix):
            yield key
            if backward:
                it.prev()
            else:
                it.next()

    def clear_keys(self) -> None:
        """Delete every rank and recency key (before rebuilding them for another policy)."""
        for prefix in (RANK, RECENCY):
            self.index.delete_range(prefix, bytes([prefix[0] + 1]))
            self.floors[prefix] = prefix
