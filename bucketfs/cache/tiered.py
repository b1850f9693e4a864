"""The block cache in front of the origin: RAM, then SSD (promoting what it finds), then
one fetch from the bucket shared by every reader that misses the same block.

A block fetched from the origin goes into RAM and is written through to SSD in the
background, so what RAM evicts is already on SSD (it "demotes" without a second copy)
and a crash loses only writes still in the queue. The queue is bounded in bytes; a
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

import logging
import time
from dataclasses import dataclass, field

import trio

from bucketfs.backends.store import ObjectStore
from bucketfs.cache.blocks import BlockId, ObjectRef, block_span
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.ram import RamTier
from bucketfs.tasks import failed

log = logging.getLogger(__name__)


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


@dataclass(eq=False, slots=True)
class _Flight:
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes = b""
    error: Exception | None = None
    cancelled: bool = False


class BlockCache:
    def __init__(
        self, store: ObjectStore, ram: RamTier, disk: DiskTier | None, *, block_size: int,
        nursery: trio.Nursery, disk_threads: int = 4, write_queue: int = 64 * 1024**2,
    ) -> None:
        if disk is not None and disk.block_size != block_size:
            raise ValueError(f"the SSD tier cuts {disk.block_size}-byte blocks, the cache "
                             f"{block_size}-byte ones")
        self.store = store
        self.ram = ram
        self.disk = disk
        self.block_size = block_size
        self.nursery = nursery
        self.disk_limiter = trio.CapacityLimiter(disk_threads)
        self.inflight: dict[BlockId, _Flight] = {}
        #: Fetched, not yet on SSD: flush() must not lose these.
        self.writing: dict[BlockId, tuple[bytes, float]] = {}
        self.queued = 0
        self.queue_limit = max(write_queue, block_size)
        self._room = trio.Event()
        self.stats = CacheStats()

    async def get(self, obj: ObjectRef, index: int) -> bytes:
        """The bytes of block `index` of that object version."""
        block = BlockId(obj.key, obj.version, index, size=obj.size)
        while True:
            data = self.ram.get(block)
            if data is not None:
                self.stats.ram_hits += 1
                self.stats.ram_bytes_served += len(data)
                return data
            flight = self.inflight.get(block)
            if flight is None:
                break
            self.stats.single_flight_waits += 1
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            if not flight.cancelled:
                return flight.data
            # The task that looked it up was cancelled (not failed): look again ourselves.
        flight = self.inflight[block] = _Flight()
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
            flight.done.set()
            del self.inflight[block]

    def held(self, block: BlockId) -> tuple[bytes, float] | None:
        """The block's bytes and cost if RAM or the write-through queue has them; no
        lookup, no counters, no change to the eviction order (trio thread)."""
        data = self.ram.blocks.get(block)
        if data is not None:
            return data, self.ram.costs[block]
        return self.writing.get(block)

    def holds(self, block: BlockId) -> bool:
        """Whether a tier holds the block (no I/O but one index read; trio thread)."""
        if block in self.ram.blocks or block in self.writing:
            return True
        return self.disk is not None and self.disk.holds(block)

    async def _lookup(self, obj: ObjectRef, block: BlockId) -> bytes:
        queued = self.writing.get(block)
        if queued is not None:  # evicted from RAM while its write to SSD is under way
            data, cost = queued
            self.stats.ram_hits += 1
            self.stats.ram_bytes_served += len(data)
            self.ram.put(block, data, cost)
            return data
        if self.disk is not None:
            found = await trio.to_thread.run_sync(self.disk.get, block,
                                                  self.ram.capacity // 4,
                                                  limiter=self.disk_limiter)
            if found is not None:
                data, cost, following = found
                self.stats.disk_hits += 1
                self.stats.disk_bytes_served += len(data)
                self.ram.put(block, data, cost)
                for ahead, ahead_data, ahead_cost in following:
                    if ahead not in self.ram.blocks:
                        self.ram.put(ahead, ahead_data, ahead_cost)
                        self.stats.disk_read_ahead += 1
                return data
        start, end = block_span(obj.size, self.block_size, block.index)
        began = time.monotonic()
        data = await self.store.get_range(obj.key, obj.version, start, end - start)
        cost = time.monotonic() - began
        self.stats.misses += 1
        self.stats.origin_bytes += len(data)
        self.ram.put(block, data, cost)
        if self.disk is not None and self.disk.writable:
            await self._queue_write(block, data, cost)
        return data

    async def _queue_write(self, block: BlockId, data: bytes, cost: float) -> None:
        while self.queued + len(data) > self.queue_limit:
            await self._room.wait()
        if block in self.writing:
            return
        self.queued += len(data)
        self.writing[block] = (data, cost)
        self.nursery.start_soon(self._write_through, block)

    async def _write_through(self, block: BlockId) -> None:
        assert self.disk is not None
        data, cost = self.writing[block]
        try:
            if await trio.to_thread.run_sync(self.disk.put, block, data, cost,
                                             limiter=self.disk_limiter):
                self.stats.disk_writes += 1
        except Exception as exc:  # a bug in the SSD tier: the block stays a RAM block
            failed("writing a block to the SSD tier", exc)
        finally:
            del self.writing[block]
            self.queued -= len(data)
            # Wake every waiter; each checks again whether its block fits now.
            self._room.set()
            self._room = trio.Event()

    async def flush(self) -> None:
        """Write what is still queued, or only in RAM, to SSD, so the next mount finds it
        (on a clean unmount). Blocks already on SSD are skipped by the tier."""
        if self.disk is None:
            return
        waiting = [(b, d, c) for b, (d, c) in self.writing.items()]
        waiting += [(b, d, self.ram.costs[b]) for b, d in self.ram.blocks.items()]
        for block, data, cost in waiting:
            await trio.to_thread.run_sync(self.disk.put, block, data, cost,
                                          limiter=self.disk_limiter)
        # put() skips blocks a write-through task is still writing: wait for those.
        while self.writing:
            await self._room.wait()
