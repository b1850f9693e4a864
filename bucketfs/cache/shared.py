"""The shared tier: a bucket near every node, between the SSD tier and the origin.

A block missed in RAM and on SSD is looked up here before the origin (`get`), and
what the origin sends is offered here (`offer`) and written in the background, so a
cluster reads each block from the origin about once. Only objects up to `max_object`
bytes take part: small files are where the origin's latency hurts, and large ones
would fill the tier.

Nothing here may slow a reader down or take the mount down:
  - a GET is one attempt with a short timeout (shared_store.py); anything but a valid
    block is a miss, and the origin serves the read;
  - writes wait in a queue bounded in bytes; a block that does not fit is not shared
    (counted as dropped), never waited for;
  - a failing tier (down, slow, full, refusing) is given a rest: after a failure,
    reads (and, separately, writes) skip it for a while, doubling from 1 s to a minute
    while it keeps failing. The first failure of an outage logs one warning, the
    recovery one line.

Concurrency: everything here runs in the trio thread except the store's calls and the
digests, which run in worker threads behind one limiter for reads and one for writes.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import trio

from bucketfs.cache.blocks import BlockId, ObjectRef
from bucketfs.cache.shared_names import (
    BLOCK_ID,
    Dataset,
    SharedNames,
    describe,
    identity,
    mismatch,
)
from bucketfs.cache.shared_store import SharedError, SharedStore
from bucketfs.tasks import failed
from bucketfs.workers import in_worker

log = logging.getLogger(__name__)

FIRST_REST_S = 1.0
LONGEST_REST_S = 60.0
_WRITERS = 4
#: Blocks written per worker-thread call.
_PUT_BATCH = 8
#: Invalid objects logged one by one; after these, only counted.
_INVALID_LOGGED = 10


@dataclass(slots=True)
class SharedStats:
    """What the shared tier did (status and metrics read these)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    #: Objects found under a block's name that were not that block (corrupt, foreign,
    #: stale): misses too.
    invalid: int = 0
    #: Lookups and writes that failed (timeouts, refused connections, errors).
    errors: int = 0
    #: Lookups and writes not tried because the tier was resting.
    skipped: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    #: Blocks not shared because the write queue was full.
    dropped: int = 0
    requests: dict[str, int] = field(
        default_factory=lambda: {"get": 0, "put": 0, "list": 0, "delete": 0})


class _Rest:
    """When one direction (reads or writes) of the tier may be tried again."""

    def __init__(self) -> None:
        self.until = 0.0
        self.length = FIRST_REST_S
        self.failing = False

    def resting(self) -> bool:
        return self.failing and time.monotonic() < self.until

    def failed(self) -> None:
        self.until = time.monotonic() + self.length
        self.length = min(self.length * 2, LONGEST_REST_S)
        self.failing = True

    def worked(self) -> None:
        self.failing = False
        self.length = FIRST_REST_S


class SharedTier:
    def __init__(self, store: SharedStore, dataset: Dataset, nursery: trio.Nursery, *,
                 max_object: int, write_queue: int, connections: int = 16) -> None:
        self.store = store
        self.dataset = dataset
        self.names = SharedNames(store.prefix)
        #: Where this dataset's blocks are: a block's name is this and its id.
        self._blocks = self.names.blocks(dataset)
        self.nursery = nursery
        self.max_object = max_object
        self.queue_limit = write_queue
        self.stats = SharedStats()
        self.read_limiter = trio.CapacityLimiter(connections)
        self.write_limiter = trio.CapacityLimiter(_WRITERS)
        self._reads = _Rest()
        self._writes = _Rest()
        self._unwritten: collections.deque[tuple[BlockId, object]] = collections.deque()
        self.queued = 0
        self._writers = 0
        self._idle = trio.Event()
        self._idle.set()

    @property
    def url(self) -> str:
        return str(self.store.url)

    @property
    def up(self) -> bool:
        """Neither reads nor writes are resting after a failure."""
        return not (self._reads.failing or self._writes.failing)

    def shares(self, obj: ObjectRef) -> bool:
        return 0 < obj.size <= self.max_object  # an empty object costs no GET anyway

    # --- reads ----------------------------------------------------------------------------

    async def get(self, block: BlockId, length: int) -> bytes | None:
        """The block's `length` bytes if the tier holds them, checked; else None."""
        if self._reads.resting():
            self.stats.skipped += 1
            return None
        self.stats.lookups += 1
        self.stats.requests["get"] += 1
        expected = identity(self.dataset, block)
        name = self._blocks + expected[BLOCK_ID]

        def fetch() -> tuple[object | None, str | None]:
            found = self.store.get(name)
            if found is None:
                return None, None
            wrong = mismatch(expected, found.metadata, found.data, length)
            return (None, wrong) if wrong else (found.data, None)

        try:
            data, wrong = await in_worker(fetch, limiter=self.read_limiter)
        except SharedError as exc:
            self.stats.errors += 1
            self._failed(self._reads, exc)
            return None
        except Exception as exc:  # a bug here: the origin serves the read all the same
            self.stats.errors += 1
            failed("looking a block up in the shared tier", exc)
            return None
        self._worked(self._reads)
        if wrong is not None:
            self.stats.invalid += 1
            if self.stats.invalid <= _INVALID_LOGGED:
                log.warning("shared tier: %s is not block %d of %r (%s); reading the "
                            "origin%s", name, block.index, block.key, wrong,
                            "" if self.stats.invalid < _INVALID_LOGGED else
                            " (further ones are counted in status, not logged)")
            return None
        if data is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(data)  # type: ignore[arg-type]
        return data  # type: ignore[return-value]

    # --- writes ---------------------------------------------------------------------------

    def offer(self, block: BlockId, data: object) -> None:
        """Share a block the origin sent, in the background, if there is room."""
        if self._writes.resting():
            self.stats.skipped += 1
            return
        size = len(data)  # type: ignore[arg-type]
        if self.queued + size > self.queue_limit:
            self.stats.dropped += 1
            return
        self.queued += size
        self._unwritten.append((block, data))
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        if self._writers < _WRITERS:
            self._writers += 1
            self.nursery.start_soon(self._write)

    async def _write(self) -> None:
        try:
            while self._unwritten:
                batch = [self._unwritten.popleft()
                         for _ in range(min(_PUT_BATCH, len(self._unwritten)))]
                try:
                    await self._put(batch)
                except Exception as exc:  # a bug here must not end the mount
                    failed("writing blocks to the shared tier", exc)
                finally:
                    self.queued -= sum(len(data) for _, data in batch)  # type: ignore[arg-type]
        finally:
            self._writers -= 1
            if self._writers == 0 and not self._unwritten:
                self._idle.set()

    async def _put(self, batch: list[tuple[BlockId, object]]) -> None:
        """PUT a few blocks one after the other in one worker thread (a thread hop costs
        more CPU than the rest of a small block's PUT); the first failure ends the
        batch."""
        if self._writes.resting():  # it failed while these blocks waited
            self.stats.skipped += len(batch)
            return
        def put() -> tuple[int, SharedError | None]:
            for done, (block, data) in enumerate(batch):
                metadata = describe(self.dataset, block, data)
                try:
                    self.store.put(self._blocks + metadata[BLOCK_ID], data, metadata)
                except SharedError as exc:
                    return done, exc
            return len(batch), None

        written, error = await in_worker(put, limiter=self.write_limiter)
        self.stats.requests["put"] += written + (error is not None)
        self.stats.writes += written
        self.stats.bytes_written += sum(len(data) for _, data in batch[:written])  # type: ignore[arg-type]
        if error is None:
            self._worked(self._writes)
            return
        self.stats.errors += 1
        self.stats.skipped += len(batch) - written - 1
        self._failed(self._writes, error)

    async def announce(self) -> None:
        """Write the dataset's descriptor (what `bucketfs cache shared-list` shows)."""
        name = self.names.descriptor(self.dataset)
        self.stats.requests["put"] += 1
        try:
            await in_worker(self.store.put, name, self.dataset.descriptor(), {},
                            limiter=self.write_limiter)
        except SharedError as exc:
            self.stats.errors += 1
            self._failed(self._writes, exc)
            return
        self._worked(self._writes)

    async def drain(self, seconds: float) -> None:
        """Wait (at most `seconds`) for the queued writes, so that blocks a node read
        just before it unmounted are shared too."""
        with trio.move_on_after(seconds):
            await self._idle.wait()
        if self._unwritten or self._writers:
            log.info("unmounting with %d block(s) not yet written to the shared tier",
                     len(self._unwritten) + self._writers)

    # --- health ---------------------------------------------------------------------------

    def _failed(self, rest: _Rest, exc: SharedError) -> None:
        first = self.up
        rest.failed()
        if first:
            log.warning("%s; the origin serves every read, and the shared tier is tried "
                        "again in %.0f s", exc, rest.until - time.monotonic())
        else:
            log.debug("%s", exc)

    def _worked(self, rest: _Rest) -> None:
        if rest.failing:
            rest.worked()
            if self.up:
                log.info("shared tier %s answers again", self.url)
