"""Reads of open files, block by block through the cache, with sequential read-ahead.

Each open handle pins the object version it saw at open, so every byte it returns comes
from that one version. A read asks the `BlockCache` for the blocks that hold its bytes
(RAM, SSD, or one GET shared by all who miss it) and slices them. When the reader is
sequential, `prefetch.readahead` decides how far ahead to go and the following blocks
are requested in the background, so they are in RAM by the time the reader gets there.
Bytes requested ahead and not yet arrived count against one `ByteBudget` shared by all
handles: however many files are open, read-ahead never holds more than the budget in
flight; what has arrived is the RAM tier's to account for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from bucketfs.cache.blocks import ObjectRef, block_span, blocks_covering
from bucketfs.cache.tiered import BlockCache
from bucketfs.prefetch.readahead import SequentialWindow

log = logging.getLogger(__name__)


class ByteBudget:
    """Bytes that read-ahead may have in flight, across every open file."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0

    def try_acquire(self, amount: int) -> bool:
        if self.used + amount > self.limit:
            return False
        self.used += amount
        self.peak = max(self.peak, self.used)
        return True

    def release(self, amount: int) -> None:
        self.used -= amount
        assert self.used >= 0, "released more than was acquired"


@dataclass(frozen=True, slots=True)
class ReadSettings:
    readahead_initial: int = 1024**2
    readahead_max: int = 64 * 1024**2


#: Blocks whose read bytes a handle counts at once (the oldest count is dropped past it).
COUNTED_BLOCKS = 64


class OpenFile:
    __slots__ = ("last", "next_block", "obj", "read_of_block", "window")

    def __init__(self, obj: ObjectRef, settings: ReadSettings, *,
                 one_block: bool = False) -> None:
        """`one_block`: the object is one block, so there is nothing to read ahead
        (most files of an image dataset): no window is kept."""
        self.obj = obj
        initial = min(settings.readahead_initial, settings.readahead_max)
        self.window = None if one_block else SequentialWindow(
            obj.size, initial=initial, maximum=settings.readahead_max)
        #: Blocks below this index have been requested ahead (or read) already.
        self.next_block = 0
        #: The last block read, kept only when the RAM tier cannot hold it (a RAM tier
        #: smaller than a block): the kernel's next read of the same block must not
        #: fetch it again.
        self.last: tuple[int, bytes] | None = None
        #: Bytes read so far of the blocks partly read (block index -> bytes): a block
        #: read to its last byte leaves RAM (`BlockCache.read_through`).
        self.read_of_block: dict[int, int] = {}


class Reader:
    """Serves reads for every open handle of one mount."""

    def __init__(
        self, cache: BlockCache, budget: ByteBudget, settings: ReadSettings,
        nursery: trio.Nursery, *, on_open: Callable[[str], None] | None = None,
    ) -> None:
        """`on_open(key)`: told of every opened file (hinted prefetch follows the
        readers by it)."""
        self.cache = cache
        self.block_size = cache.block_size
        self.budget = budget
        self.settings = settings
        self.nursery = nursery
        self.prefetches = 0
        self.on_open = on_open
        #: What the kernel asked of the daemon: files opened (with kernel_opens, reads
        #: at a file's start), read requests, and the bytes they returned. Reads the
        #: kernel's page cache served never come here.
        self.opens = 0
        self.reads = 0
        self.bytes_read = 0

    def open(self, key: str, version: str, size: int) -> OpenFile:
        self.opens += 1
        if self.on_open is not None:
            self.on_open(key)
        return OpenFile(ObjectRef(key, version, size), self.settings,
                        one_block=size <= self.block_size)

    async def read(self, handle: OpenFile, offset: int, length: int) -> bytes | memoryview:
        """Bytes [offset, offset + length) of the handle's version, clamped to its size.
        A read within one block is a view of the cached block (no copy: pyfuse3 replies
        from any buffer); one that spans blocks is joined."""
        self.reads += 1
        obj = handle.obj
        end = min(offset + length, obj.size)
        if offset >= end:
            return b""
        if handle.window is None:  # one block: no read-ahead, no joins
            data = memoryview(await self._block(handle, 0))[offset:end]
        else:
            data = await self._read_blocks(handle, handle.window, offset, end)
        if len(data) != end - offset:  # blocks are exact; anything else is a bug
            raise RuntimeError(f"assembled {len(data)} bytes for a read of {end - offset}")
        self.bytes_read += len(data)
        return data

    async def _read_blocks(self, handle: OpenFile, window: SequentialWindow, offset: int,
                           end: int) -> bytes | memoryview:
        """[offset, end) of a file of several blocks, reading ahead as `window` says."""
        obj = handle.obj
        needed = blocks_covering(obj.size, self.block_size, offset, end)
        ahead_until = block_span(obj.size, self.block_size, handle.next_block - 1)[1] \
            if handle.next_block > needed.start else offset
        plan = window.on_read(offset, end, max(ahead_until, offset))
        if not plan.sequential:
            handle.next_block = needed.stop  # a seek: read-ahead starts over from here
        else:
            self._read_ahead(handle, max(handle.next_block, needed.stop), plan.fetch_until)
        chunks = []
        for index in needed:
            start = index * self.block_size
            block = memoryview(await self._block(handle, index))
            chunk = block[max(offset, start) - start:min(end, start + len(block)) - start]
            chunks.append(chunk)
            self._count_read(handle, index, len(chunk), len(block))
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _count_read(self, handle: OpenFile, index: int, length: int, block_length: int,
                    ) -> None:
        """Count `length` bytes of block `index` as read; once all its bytes were (the
        page cache then holds them: a byte read twice counts twice, which at worst lets
        a block go early), the cache may let its RAM copy go."""
        if self.cache.disk is None:
            return  # RAM is the only copy: nothing is let go, so nothing to count
        counts = handle.read_of_block
        read = counts.pop(index, 0) + length
        if read >= block_length:
            self.cache.read_through(handle.obj, index)
            return
        counts[index] = read
        if len(counts) > COUNTED_BLOCKS:
            del counts[next(iter(counts))]

    async def _block(self, handle: OpenFile, index: int) -> bytes:
        if handle.last is not None and handle.last[0] == index:
            return handle.last[1]
        data = await self.cache.get(handle.obj, index)
        if not self.cache.keeps_in_ram(len(data)):
            handle.last = (index, data)
        return data

    def _read_ahead(self, handle: OpenFile, first: int, until: int) -> None:
        """Request blocks [first, the block holding `until`) in the background."""
        obj = handle.obj
        index = first
        while index * self.block_size < min(until, obj.size):
            start, end = block_span(obj.size, self.block_size, index)
            if not self.cache.keeps_in_ram(end - start):
                break  # nowhere to keep it until the reader gets there: it would be fetched twice
            if not self.budget.try_acquire(end - start):
                break
            self.nursery.start_soon(self._prefetch, obj, index, end - start)
            index += 1
        handle.next_block = max(handle.next_block, index)

    async def _prefetch(self, obj: ObjectRef, index: int, size: int) -> None:
        try:
            await self.cache.get(obj, index)
            self.prefetches += 1
        except Exception as exc:  # the reader that needs it will fetch (and report) it
            log.debug("read-ahead of %r block %d failed: %s", obj.key, index, exc)
        finally:
            self.budget.release(size)
