"""Large blocks' memory used again: a block the RAM tier lets go becomes the buffer of
a later GET, instead of going back to the system while the GET maps fresh memory.

Why: every page of fresh memory costs a fault and the kernel zeroing it on first touch.
Reading a 1 GiB object through a RAM tier smaller than it, each 4 MiB block evicts one,
and those faults were a fifth of the daemon's CPU (docs/BENCHMARKS.md, step 35). Only
bodies from `MIN_SIZE` are concerned: smaller ones come from the allocator's heap, which
reuses freed memory already.

When a buffer is free: a block's bytes are handed out only as memoryviews of one buffer
(the GET's, curl_multi.py: a private mapping whose pages the kernel faulted in when it
mapped them, or one of huge pages from huge_buffers.py),
and every view, slice or C caller holding its bytes keeps a reference to that object. So
a buffer that nothing but this module refers to has no reader left, and its bytes may be
overwritten. `take` checks exactly that, with `sys.getrefcount` against the count an
idle buffer has (`_IDLE_REFS`, measured on this interpreter with the same loop). A
buffer is taken only at that count, so a block still being replied from, written to the
SSD tier or sent to the shared tier is never touched, and a GET overwrites every byte it
returns (a short body is refused, curl_gets.py).

Sizes: a GET's buffer is as long as its body's size class (`size_class`: eight classes
per doubling, at most 1/8 longer than the body), and its body a view of its start. So a
block let go serves a later body of any size in its class: files of a few MiB each of
its own size (photographs, audio) share buffers, where one buffer per exact size never
found a second use (a cold pass of ~2 MiB files: 0 of 400 GETs given a spare, against
256 of 400 when every file had the same size; docs/BENCHMARKS.md, step 51). A large
object's blocks (the block size, a power of two) are their class exactly. The RAM tier
charges such a block its buffer's whole length (`held_bytes`), so its budget still
bounds the memory.

The SSD tier's direct reads of large block files (file_reads.py) get the same: a block
read from SSD is a view of a private mapping that also holds the file's header page, and
when the RAM tier lets it go the mapping is kept (`SpareMappings`, `reads`) for the next
read of a file of the same size class, whose direct read then lands in pages already
faulted in (27% of the daemon's CPU reading a 1 GiB object from the SSD tier was faults
on fresh mappings: docs/BENCHMARKS.md, step 40; by size class since step 52). Those
reads run in worker threads, so that pool is under a lock; the idle check holds there
too: a worker thread can only drop references to a mapping, and nothing makes one from
a mapping no view refers to.

Memory: the spare buffers are at most `limit` bytes (the mount sets it to its
`readahead_max`: a read-ahead window starts that many GETs at once, and its blocks'
evictions come back together), and `let_go_if_idle`, called every `IDLE_S` seconds,
drops them all once a period passed without a GET taking or a block offering one (and
the same for the mappings). Trio thread only, but for `SpareMappings.take`. Off where the
interpreter runs without the GIL, whose reference counts are not exact.
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections import deque
from typing import Any

import trio

from bucketfs import huge_buffers
from bucketfs.cache.direct_writes import private_pages
from bucketfs.huge_buffers import ReadMapping, size_class

#: Bodies from this size get their own mapping (mount.py's mmap threshold), so only
#: they come back as fresh pages.
MIN_SIZE = 1024 * 1024
#: Seconds without a take or an offer after which the spare buffers go.
IDLE_S = 2.0


class GetBuffer(mmap.mmap):
    """A GET's body buffer: a private mapping (populated, or in huge pages:
    huge_buffers.py) of a size class's length, which the GET writes from its start with
    the mapping's own `write` (curl_multi.py). Its own type, so that a view of one is
    told from a view of another mapping (an SSD tier's read, `SpareMappings`)."""

    __slots__ = ()


Buffer = GetBuffer


def held_bytes(data: object) -> int:
    """The memory a block's bytes hold: a GET's buffer or an SSD read's mapping in
    ordinary pages whole (its size class), else their length (a read's mapping of huge
    pages reaches 2 MiB past what it holds, untouched)."""
    if type(data) is memoryview:
        kind = type(data.obj)
        if kind is GetBuffer or kind is ReadMapping:
            return len(data.obj)
    return len(data)  # type: ignore[arg-type]


def _idle_count(spare: deque[Buffer]) -> int:
    for i in range(len(spare)):  # the very loop `take` runs, on a buffer only it holds
        buffer = spare[i]
        return sys.getrefcount(buffer)
    raise AssertionError("unreachable")


def _remember(sizes: set[int], size: int) -> None:
    """Note a size taken: a spare of another size would never be taken."""
    if size not in sizes:
        if len(sizes) >= 64:  # files of many sizes: remember the recent ones
            sizes.clear()
        sizes.add(size)


def _take_idle(spare: deque[Any], size: int) -> Any:
    """The first spare of `size` bytes that nothing else refers to, out of `spare`; None
    if there is none. By index: deque.remove would compare contents, and could drop
    another buffer that holds the same bytes."""
    for i in range(len(spare)):  # as `_idle_count` measures it
        buffer = spare[i]
        if len(buffer) == size and sys.getrefcount(buffer) == _IDLE_REFS:
            del spare[i]
            return buffer
    return None


_IDLE_REFS = _idle_count(deque([bytearray(1)]))
_EXACT_COUNTS: bool = getattr(sys, "_is_gil_enabled", lambda: True)()


class SpareMappings:
    """Mappings of large blocks read from SSD block files (file_reads.py), let go by the
    RAM tier, kept for the next direct read of a file of the same size class (see the
    module's doc). `take` runs in the SSD tier's worker threads, `offer` on the trio
    thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._spare: deque[mmap.mmap] = deque()
        self._lock = threading.Lock()
        #: The mapping lengths reads asked for: one of another length is never taken.
        self._sizes: set[int] = set()
        self._active = False
        #: Reads given a spare mapping, and given a fresh one.
        self.reused = 0
        self.fresh = 0

    def take(self, length: int) -> mmap.mmap | None:
        """A spare mapping of `length` bytes no one refers to any more, else None (the
        caller maps fresh memory). Its bytes are whatever it held."""
        with self._lock:
            self._active = True
            _remember(self._sizes, length)
            mapping: mmap.mmap | None = _take_idle(self._spare, length)
            if mapping is None:
                self.fresh += 1
            else:
                self.reused += 1
            return mapping

    def offer(self, mapping: mmap.mmap) -> None:
        """The mapping of a block the RAM tier let go; kept if reads take that length,
        the oldest going past `limit` (but one: a mapping is a page or a huge page
        longer than its block, and a `limit` of one block must still keep one)."""
        with self._lock:
            if len(mapping) not in self._sizes:
                return
            self._active = True
            self._spare.append(mapping)
            while len(self._spare) > 1 and sum(map(len, self._spare)) > self.limit:
                self._spare.popleft()

    def let_go_if_idle(self) -> None:
        with self._lock:
            if not self._active:
                self._spare.clear()
            self._active = False

    @property
    def spare_bytes(self) -> int:
        with self._lock:  # a worker's `take` may be changing the pool
            return sum(map(len, self._spare))


class SpareBuffers:
    def __init__(self, limit: int = 64 * 1024 * 1024) -> None:
        #: The SSD tier's read mappings, kept as this pool keeps GET buffers.
        self.reads = SpareMappings(limit)
        self.limit = limit
        self._spare: deque[Buffer] = deque()
        self._active = False
        #: The sizes GETs asked for: a buffer of another size would never be taken.
        self._sizes: set[int] = set()
        #: GETs given a spare buffer, and given fresh memory.
        self.reused = 0
        self.fresh = 0

    def take(self, size: int) -> Buffer:
        """A buffer for a body of `size` bytes, as long as its size class: a spare one no
        one refers to any more, else a new one. Its bytes are whatever it held: the
        caller overwrites all it hands out, and hands out no more."""
        self._active = True
        length = size_class(size)
        _remember(self._sizes, length)
        buffer: Buffer | None = _take_idle(self._spare, length)
        if buffer is not None:
            self.reused += 1
            return buffer
        self.fresh += 1
        if huge_buffers.settings.enabled and length >= huge_buffers.HUGE_PAGE:
            return huge_buffers.fresh(length, kind=GetBuffer)
        # Not bytearray(size): it faults each page in as it zeroes it, one trap per 4
        # KiB; populated, the kernel does them all in the one call (step 43).
        return private_pages(length, populate=True, kind=GetBuffer)

    def offer(self, data: object) -> None:
        """A block let go (evicted, removed): its buffer is kept to be taken again, once
        its last reader is done with it; the oldest spare goes past `limit`. Anything
        but a GET's body (a view of a GET's buffer, from its start: the only view of one
        a block is) of a size class GETs take is left alone."""
        if not _EXACT_COUNTS or type(data) is not memoryview:
            return
        buffer = data.obj
        kind = type(buffer)
        if kind is ReadMapping or (kind is mmap.mmap and data.nbytes != len(buffer)):
            self.reads.offer(buffer)  # read from SSD: its mapping holds the header too
            return
        if kind is not GetBuffer or len(buffer) < MIN_SIZE \
                or len(buffer) not in self._sizes or len(buffer) > self.limit:
            return
        self._active = True
        self._spare.append(buffer)
        while self.spare_bytes > self.limit:
            self._spare.popleft()

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, limit: int) -> None:
        self._limit = self.reads.limit = limit

    def let_go_if_idle(self) -> None:
        """Drop every spare buffer if nothing took or offered one since the last call."""
        if not self._active:
            self._spare.clear()
        self._active = False
        self.reads.let_go_if_idle()

    @property
    def spare_bytes(self) -> int:
        """A sum over a few buffers (the limit keeps them to a read-ahead window's), in
        one C call: a metrics scrape reads it from its own thread while the trio thread
        changes the deque, and no bytecode runs in between to let that thread in."""
        return sum(map(len, self._spare))

    async def let_go_when_idle(self) -> None:
        """The daemon's task calling `let_go_if_idle` every `IDLE_S` seconds."""
        while True:
            await trio.sleep(IDLE_S)
            self.let_go_if_idle()


#: The daemon's one pool: the GETs take from it (curl_multi.py), the RAM tier offers
#: to it (cache/ram.py).
spare_buffers = SpareBuffers()
