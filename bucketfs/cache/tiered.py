"""The block cache in front of the origin: RAM, then SSD (promoting what it finds), then
the shared tier of the cluster if the mount has one (shared.py), then one fetch from
the bucket shared by every reader that misses the same block. This is the only code
that knows there are tiers: readers, hinted prefetch and chunk packing ask it, never a
tier. What the origin sends is offered to the shared tier, which writes it in the
background.

A block fetched from the origin goes into RAM and is written through to SSD in the
background, in batches that share one flush of the device, so what RAM evicts is already
on SSD (it "demotes" without a second copy) and a crash loses only writes still in the
queue. The queue is bounded in bytes; a
fetch that finds it full waits for room, so a slow disk slows the reader down instead
of silently dropping blocks.

A small file packed in an SSD chunk (chunks.py) is read with the members after it when
the read starts or continues a pass over the chunk: one pread brings them all, and they
go into RAM, so a chunk laid out in read order is read once, sequentially. At most a
quarter of the RAM tier's budget comes ahead per read.

Concurrency (see docs/ARCHITECTURE.md): everything here runs in the trio thread except
the SSD tier's calls, which run in worker threads behind `disk_limiter`. `inflight` maps
a block to the one lookup under way for it (SSD read or GET); others wait on its Event.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from bucketfs.backends.store import ObjectStore
from bucketfs.cache.blocks import BlockId, ObjectRef, block_span
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.ram import RamTier
from bucketfs.cache.shared import SharedTier
from bucketfs.cache.tier import CacheEvents, Hit, Tier
from bucketfs.spare_buffers import spare_buffers
from bucketfs.tasks import failed
from bucketfs.workers import CallQueue, in_worker

log = logging.getLogger(__name__)

#: Write-through batches: one device flush and one index write for up to this many
#: blocks (or bytes), by at most `_WRITERS` tasks at once.
_BATCH_BLOCKS = 64
_BATCH_BYTES = 32 * 1024**2
_WRITERS = 2
#: A writer that finds fewer than `_FULL_BLOCKS` blocks (and `_FULL_BYTES`) waiting
#: gives the readers up to `_LINGER_S` to queue more: taken as they came, cold reads
#: made batches of 3.6 blocks on average, and each batch costs a thread hop, a device
#: flush and an index write (2,000 cold 100 KB files: 0.95 -> 0.87 ms of daemon CPU
#: each, docs/BENCHMARKS.md). A full batch is about one write-through chunk of ~100 KB
#: files (40 blocks, 3.5 MiB; the chunk's limit is 4 MiB): against 16 blocks, 8 MiB and
#: 20 ms, 0.61-0.655 -> 0.60-0.625 ms per cold file (BENCHMARKS, step 16). It delays
#: durability by up to `_LINGER_S`, never a read; one writer gathers at a time, while
#: the other writes.
_FULL_BLOCKS = 40
_FULL_BYTES = 3584 * 1024
_LINGER_S = 0.05


@dataclass(slots=True)
class CacheStats:
    ram_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    ram_bytes_served: int = 0
    disk_bytes_served: int = 0
    origin_bytes: int = 0
    single_flight_waits: int = 0
    disk_writes: int = 0
    #: Blocks that came into RAM with the read of an earlier member of their SSD chunk.
    disk_read_ahead: int = 0
    shared_hits: int = 0
    shared_bytes_served: int = 0
    #: Blocks of which a reader read every byte, let go from RAM because the SSD tier
    #: has them (`BlockCache.read_through`).
    ram_released: int = 0


@dataclass(eq=False, slots=True)
class _Flight:
    #: Made by the first reader that joins: most lookups have none, and an event made
    #: and set for nobody was a share of every miss's work on the trio thread.
    done: trio.Event | None = None
    data: bytes = b""
    error: Exception | None = None
    cancelled: bool = False


class BlockCache:
    def __init__(
        self, store: ObjectStore, ram: RamTier, disk: DiskTier | None, *, block_size: int,
        nursery: trio.Nursery, disk_threads: int = 4, write_queue: int = 64 * 1024**2,
        shared: SharedTier | None = None,
    ) -> None:
        """`ram.events` is the cache's `events`: subscribe there to follow evictions.
        `shared`: the tier between the SSD tier and the origin, if the mount has one."""
        if disk is not None and disk.block_size != block_size:
            raise ValueError(f"the SSD tier cuts {disk.block_size}-byte blocks, the cache "
                             f"{block_size}-byte ones")
        self.store = store
        self.ram = ram
        self.disk = disk
        self.shared = shared
        self.events: CacheEvents = ram.events
        self.block_size = block_size
        self.nursery = nursery
        self.disk_limiter = trio.CapacityLimiter(disk_threads)
        #: The read path's SSD lookups: readers that miss RAM together share thread
        #: hops and wakeups (workers.CallQueue).
        self.disk_reads: CallQueue[BlockId, Hit | None] = CallQueue(
            self._read_disk, threads=disk_threads)
        self.inflight: dict[BlockId, _Flight] = {}
        #: Fetched, not yet on SSD: flush() must not lose these.
        self.writing: dict[BlockId, tuple[bytes, float]] = {}
        self.queued = 0
        self.queue_limit = max(write_queue, block_size)
        #: Queued blocks no write-through task has taken yet, and how many tasks write.
        self._unwritten: collections.deque[BlockId] = collections.deque()
        self._unwritten_bytes = 0
        self._writers = 0
        #: A writer is gathering a batch: no other starts or gathers meanwhile.
        self._gathering = False
        self._room = trio.Event()
        #: Set when `_unwritten` makes a full batch, or the queue is half full: a
        #: lingering writer goes at once.
        self._batch_full = trio.Event()
        #: Set (and dropped) whenever a lookup starts: `kept` waits on it, not a clock.
        #: Made by the first waiter, as `_Flight.done` is.
        self._started: trio.Event | None = None
        #: Blocks read through (`read_through`) while in `writing`: their buffers go to
        #: the spare pool once the batch is written.
        self._offer_when_written: set[BlockId] = set()
        self.stats = CacheStats()

    @property
    def tiers(self) -> Sequence[Tier]:
        """The tiers, nearest first (for metrics and status)."""
        return (self.ram,) if self.disk is None else (self.ram, self.disk)

    # --- reads ----------------------------------------------------------------------------

    async def get(self, obj: ObjectRef, index: int) -> bytes:
        """The bytes of block `index` of that object version."""
        block = BlockId(obj.key, obj.version, index, size=obj.size)
        while True:
            hit = self.ram.get(block)
            if hit is not None:
                self.stats.ram_hits += 1
                self.stats.ram_bytes_served += len(hit.data)
                return hit.data
            flight = self.inflight.get(block)
            if flight is None:
                break
            self.stats.single_flight_waits += 1
            if flight.done is None:
                flight.done = trio.Event()
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            if not flight.cancelled:
                return flight.data
            # The task that looked it up was cancelled (not failed): look again ourselves.
        flight = self.inflight[block] = _Flight()
        if self._started is not None:
            self._started.set()
            self._started = None
        try:
            flight.data = await self._lookup(obj, block)
            return flight.data
        except Exception as exc:
            flight.error = exc
            raise
        except BaseException:
            flight.cancelled = True
            raise
        finally:
            if flight.done is not None:
                flight.done.set()
            del self.inflight[block]

    def peek(self, block: BlockId) -> Hit | None:
        """The block if RAM or the write-through queue has it: no lookup, no counters, no
        change to the eviction order (trio thread)."""
        return self.ram.peek(block) or self._queued(block)

    def _queued(self, block: BlockId) -> Hit | None:
        queued = self.writing.get(block)
        return None if queued is None else Hit(*queued)

    def holds(self, block: BlockId) -> bool:
        """Whether a tier holds the block (no I/O but one index read; trio thread)."""
        if self.ram.holds(block) or block in self.writing:
            return True
        return self.disk is not None and self.disk.holds(block)

    def _read_disk(self, block: BlockId) -> Hit | None:
        """The SSD tier's lookup of a block a reader wants (worker thread), with what
        follows it in its chunk, up to a quarter of the RAM tier."""
        assert self.disk is not None
        return self.disk.get(block, self.ram.capacity // 4)

    def read_through(self, obj: ObjectRef, index: int) -> None:
        """A reader has read every byte of block `index` (as one going through the
        object front to back does). The kernel's page cache now holds them, so with an
        SSD tier that has the block (or is writing it) the RAM copy only serves a reader
        whose pages the kernel dropped, which the SSD tier serves too: let it go, so that
        a large file read once does not push every other block out of the RAM tier. Its
        memory backs a later large GET (spare_buffers.py) instead of fresh pages:
        offered at once if the block is on SSD, else once its write-through is done
        (offered before, it is still in use, and no GET could take it). Without an SSD
        tier the RAM copy is the only one, and stays."""
        if self.disk is None:
            return
        block = BlockId(obj.key, obj.version, index, size=obj.size)
        if not self.ram.holds(block):
            return
        if block in self.writing:
            self.ram.remove(block, offer=False)
            self._offer_when_written.add(block)
        elif self.disk.holds(block):
            self.ram.remove(block)
        else:
            return
        self.stats.ram_released += 1

    def keeps_in_ram(self, size: int) -> bool:
        """Whether a block of `size` bytes fits the RAM tier at all (one larger is read
        but not kept, so it must not be fetched ahead)."""
        return size <= self.ram.capacity

    async def _lookup(self, obj: ObjectRef, block: BlockId) -> bytes:
        queued = self.writing.get(block)
        if queued is not None:  # evicted from RAM while its write to SSD is under way
            data, cost = queued
            self.stats.ram_hits += 1
            self.stats.ram_bytes_served += len(data)
            self.ram.put(block, data, cost)
            return data
        # One index read here spares a cold miss the hop to a worker thread.
        if self.disk is not None and self.disk.holds(block):
            hit = await self.disk_reads.call(block)
            if hit is not None:
                self.stats.disk_hits += 1
                self.stats.disk_bytes_served += len(hit.data)
                self.ram.put(block, hit.data, hit.cost)
                for ahead, ahead_data, ahead_cost in hit.following:
                    if not self.ram.holds(ahead):
                        self.ram.put(ahead, ahead_data, ahead_cost)
                        self.stats.disk_read_ahead += 1
                return hit.data
        start, end = block_span(obj.size, self.block_size, block.index)
        shared = self.shared if self.shared is not None and self.shared.shares(obj) else None
        began = time.monotonic()
        data = None if shared is None else await shared.get(block, end - start)
        if data is not None:
            self.stats.shared_hits += 1
            self.stats.shared_bytes_served += len(data)
        else:
            data = await self.store.get_range(obj.key, obj.version, start, end - start)
            self.stats.misses += 1
            self.stats.origin_bytes += len(data)
            if shared is not None:
                shared.offer(block, data)
        cost = time.monotonic() - began
        self.ram.put(block, data, cost)
        if self.disk is not None and self.disk.writable:
            await self._queue_write(block, data, cost)
        return data

    # --- the SSD tier's chunks ------------------------------------------------------------

    @property
    def writes_through(self) -> bool:
        """Whether what the origin sends is written through to a tier below RAM (what
        RAM evicts is then still cached)."""
        return self.disk is not None

    @property
    def packs(self) -> bool:
        """Whether small files can be packed into chunks (an SSD tier taking writes)."""
        return self.disk is not None and self.disk.writable

    @property
    def chunks_fetched_in_order(self) -> bool:
        """Whether the SSD tier keeps hinted small files in write-through chunks, in the
        order they were fetched (it can punch holes; else they are block files)."""
        return self.disk is not None and self.disk.chunks.holes.work

    def packed_layout(self, block: BlockId) -> bytes | None:
        """The layout tag of the SSD chunk holding the block, None if not packed."""
        return None if self.disk is None else self.disk.packed_layout(block)

    async def kept(self, obj: ObjectRef, block: BlockId, deadline: float) -> Hit | None:
        """The block's bytes if the SSD tier keeps it: from RAM, the write-through queue,
        the lookup under way or the SSD tier itself; never a GET of its own. None when
        it was read and not stored on SSD, or no read of it started by `deadline` (a
        chunk is complete when its last file is opened, and that file's read may not
        have begun yet)."""
        while True:
            if block in self.inflight:
                with contextlib.suppress(Exception):  # the reader sees its own error
                    await self.get(obj, block.index)  # joins that lookup
            queued = self._queued(block)
            if queued is not None:  # on its way to SSD
                return queued
            if self.disk is not None and self.disk.holds(block):
                held = self.ram.peek(block)
                if held is None:
                    held = await in_worker(self.disk.get, block, limiter=self.disk_limiter)
                return held
            if self.ram.holds(block):
                return None  # read, and not stored on SSD
            if self._started is None:
                self._started = trio.Event()
            with trio.move_on_at(deadline) as waiting:
                await self._started.wait()
            if waiting.cancelled_caught:
                return None

    async def write_chunk(self, blocks: list[tuple[BlockId, bytes, float]],
                          layout: bytes) -> bool:
        """Pack these blocks, in this order, into one SSD chunk tagged `layout`."""
        if self.disk is None:
            return False
        return await in_worker(self.disk.write_chunk, blocks, layout,
                               limiter=self.disk_limiter)

    # --- writes to SSD --------------------------------------------------------------------

    async def _queue_write(self, block: BlockId, data: bytes, cost: float) -> None:
        while self.queued + len(data) > self.queue_limit:
            await self._room.wait()
        if block in self.writing:
            return
        self.queued += len(data)
        self.writing[block] = (data, cost)
        self._unwritten.append(block)
        self._unwritten_bytes += len(data)
        if self._full_batch_waiting():
            self._batch_full.set()
        if self._writers < _WRITERS and not self._gathering:
            self._writers += 1
            self.nursery.start_soon(self._write_through)

    async def _write_through(self) -> None:
        """Write queued blocks to SSD in batches (one flush of the device and one index
        write each) until none is left: while a batch is written the next gathers."""
        assert self.disk is not None
        try:
            while self._unwritten and not self._gathering:
                if not self._full_batch_waiting():
                    self._gathering = True
                    try:
                        with trio.move_on_after(_LINGER_S):
                            await self._batch_full.wait()
                    finally:
                        self._gathering = False
                batch, size = [], 0
                while self._unwritten and len(batch) < _BATCH_BLOCKS and size < _BATCH_BYTES:
                    block = self._unwritten.popleft()
                    data, cost = self.writing[block]
                    batch.append((block, data, cost))
                    size += len(data)
                self._unwritten_bytes -= size
                if not self._full_batch_waiting():
                    self._batch_full = trio.Event()
                try:
                    self.stats.disk_writes += await in_worker(
                        self.disk.put_many, batch, limiter=self.disk_limiter)
                except Exception as exc:  # a bug in the SSD tier: they stay RAM blocks
                    failed("writing blocks to the SSD tier", exc)
                finally:
                    offer = self._offer_when_written
                    for block, data, _ in batch:
                        del self.writing[block]
                        if block in offer:
                            offer.discard(block)
                            if not self.ram.holds(block):  # not read into RAM again
                                spare_buffers.offer(data)
                    self.queued -= size
                    # Wake every waiter; each checks again whether its block fits now.
                    self._room.set()
                    self._room = trio.Event()
        finally:
            self._writers -= 1

    def _full_batch_waiting(self) -> bool:
        return (len(self._unwritten) >= _FULL_BLOCKS or self._unwritten_bytes >= _FULL_BYTES
                or self.queued * 2 >= self.queue_limit)

    async def flush(self) -> None:
        """Write what is still queued, or only in RAM, to SSD, so the next mount finds it
        (on a clean unmount). Blocks already on SSD are skipped by the tier."""
        if self.disk is None:
            return
        waiting = [(b, d, c) for b, (d, c) in self.writing.items()]
        waiting += list(self.ram.items())
        for start in range(0, len(waiting), _BATCH_BLOCKS):
            await in_worker(self.disk.put_many, waiting[start:start + _BATCH_BLOCKS],
                            limiter=self.disk_limiter)
        # put_many() skips blocks a write-through task is still writing: wait for those.
        while self.writing:
            await self._room.wait()
