"""The SSD tier's victims when hinted orders tell the future (hinted eviction on SSD).

The RAM tier ranks every entry by its next use (prefetch/next_use.py `HintedPolicy`); the
SSD tier may hold a million entries whose order lives in RocksDB (ranking.py), so it
cannot keep a heap of them in Python. It looks at a few candidates instead, from both
ends of the configured policy's order:

- the head (the policy's next victims): data no job announced is found there; the first
  candidate with no hinted future is evicted at once;
- the tail (the most recently or frequently used);
- what the readers have read this epoch, oldest first, walked along each plan's order
  (`behind`): its next use is in a later epoch, the farthest of all, and it is what
  Belady's MIN evicts first when the data does not fit (keeping the unread rest turns
  it into hits; keeping the just-read turns nothing into a hit this epoch). The eviction
  order alone does not find it: a file read from RAM leaves its SSD rank as it was. Each
  plan keeps a cursor at the first read file still on SSD, so this costs O(1) amortised.

Each candidate's next use comes from `Distance`: (outside every window, items until it)
or None. A chunk (several packed files, evicted whole) is as near as its nearest member.
The candidate with the largest (outside, distance) is evicted, unless the entry coming in
is used no sooner: MIN would not keep it, so it is not stored on SSD (it stays in RAM
until RAM lets it go). This is what keeps a cache smaller than an epoch full of files
the epoch has yet to read, instead of rotating what was just read through it. A tie
keeps what is there: no write is spent to change nothing, and while a new epoch's order
is still being resolved (every file looks read then, all ties) the files that epoch
will read are not rotated out. An entry with no hinted future (a reader without hints)
is always admitted by the policy's rules: unknown is not "never". Data fetched ahead for
a reader's window is read from RAM (the RAM tier keeps the window), so on SSD it is
worth only its use after that read, which is not known: it is stored only in place of
data with no hinted future, never in place of a file a reader is still to read (MIN
with RAM in front: the two tiers do not both spend room on one file). Never one inside
a reader's window while anything else is found: when every candidate is, the walk
doubles, up to `MAX_WALK` from each end; if all of those are in a window too, nothing is
evicted and the new block is not stored on SSD (it stays in RAM): the window is being read now.

Approximate by design: `WALK` candidates per end, not all entries. Runs in the SSD tier's
worker threads under its lock; `Distance` must be safe to call from any thread (it reads
plans that the trio thread updates, and a stale answer only costs a worse choice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from bucketfs.prefetch.scheduler import Plan

#: (outside every reader's window, items until the next use); None: no hinted future.
Distance = Callable[[str], tuple[bool, float] | None]

WALK = 8
MAX_WALK = 1024

#: What data coming in for a reader's window is worth on SSD: that read is served from
#: RAM (the RAM tier keeps its window), so only a later use, not known yet, could come
#: from SSD. It displaces only data with no hinted future.
_HELD_IN_RAM = (True, math.inf)

#: A candidate: (its key in the index's eviction order, its name there).
Candidate = tuple[bytes, bytes]


class HintedVictims:
    """Chooses one SSD victim among a few candidates (module docstring)."""

    def __init__(self, distance: Distance, plans: Callable[[], Sequence[Plan]] = list, *,
                 walk: int = WALK, max_walk: int = MAX_WALK) -> None:
        if not 0 < walk <= max_walk:
            raise ValueError("need 0 < walk <= max_walk")
        self.distance = distance
        self.plans = plans
        #: id(plan) -> (plan, position of the first file read that may still be on SSD)
        self._cursors: dict[int, tuple[Plan, int]] = {}
        self.walk = walk
        self.max_walk = max_walk
        #: Evictions refused because every candidate was in a reader's window.
        self.refused = 0
        #: Entries not stored because they are used later than anything they would evict.
        self.declined = 0

    def nearest(self, keys: Iterable[str]) -> tuple[bool, float] | None:
        """The nearest next use over `keys` (a chunk's members), None if none has one."""
        nearest: tuple[bool, float] | None = None
        for key in keys:
            found = self.distance(key)
            if found is not None and (nearest is None or found < nearest):
                nearest = found
        return nearest

    def behind(self, stored: Callable[[str], list[Candidate]]) -> Iterator[Candidate]:
        """What the plans' readers have read, oldest first: `stored(key)` gives a key's
        candidates on SSD (none: skipped, and the plan's cursor moves past it)."""
        plans = self.plans()
        live = {id(plan) for plan in plans}
        for gone in [i for i in self._cursors if i not in live]:
            del self._cursors[gone]
        for plan in plans:
            held = self._cursors.get(id(plan))
            cursor = held[1] if held is not None and held[0] is plan else 0
            moving = True
            while cursor < min(plan.position, len(plan.keys)):
                found = stored(plan.keys[cursor])
                if moving and not found:
                    cursor += 1
                    self._cursors[id(plan)] = (plan, cursor)
                    continue
                moving = False  # the cursor stays at the first file still stored
                yield from found
                cursor += 1

    def choose(self, head: Iterator[Candidate], tail: Iterator[Candidate],
               keys_of: Callable[[bytes], list[str]],
               incoming: tuple[bool, float] | None = None,
               behind: Iterator[Candidate] | None = None) -> Candidate | None:
        """The victim among candidates taken in turn from `behind`, `head` and `tail`; None
        when every candidate looked at is in a reader's window (or there is none), or
        when the entry coming in (its future: `incoming`) is used later than any of
        them: then, as MIN does, it is the one not kept."""
        if incoming is not None and not incoming[0]:
            incoming = _HELD_IN_RAM
        best: Candidate | None = None
        best_future: tuple[bool, float] | None = None
        seen: set[bytes] = set()
        taken, limit = 0, self.walk
        ends = [head, tail] if behind is None else [behind, head, tail]
        while ends and taken < limit:
            for end in list(ends):
                candidate = next(end, None)
                if candidate is None:
                    ends.remove(end)
                    continue
                if candidate[1] in seen:  # the head's first pick can be anywhere
                    continue
                seen.add(candidate[1])
                future = self.nearest(keys_of(candidate[1]))
                if future is None:
                    return candidate
                if best_future is None or future > best_future:
                    best, best_future = candidate, future
            taken += 1
            if taken == limit and best_future is not None and not best_future[0]:
                limit = min(2 * limit, self.max_walk)  # all in a window so far: look further
        if best_future is not None and not best_future[0]:
            self.refused += 1
            return None
        if incoming is not None and best_future is not None and incoming >= best_future:
            self.declined += 1
            return None
        return best
