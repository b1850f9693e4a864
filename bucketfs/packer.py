"""Chunk packing (LCache): the small files hinted readers open, laid out in SSD chunk
files in the order they will be read next (bucketfs/cache/chunks.py stores them).

Each opened file of a hinted order goes to its job's `NextEpochPacker`, which cuts
chunks of about 4 MiB; a complete chunk's bytes are taken from RAM or the
write-through queue, else from the file's block on SSD, never from the origin; a file
the SSD tier did not keep is left out (packing lays out what the SSD tier keeps, it does
not decide what it keeps). The SSD tier writes the chunk in a worker thread under the
cache's disk limiter. Chunks carry the 8-byte fingerprint (`layout_tag`) of the order
they are laid out for.

Which order: the one the next epoch reads. When the job announced it (an ORDER with
`next_epoch`, which HintSampler sends where the sampler makes it certain), the files
read now are packed into chunks planned by it (`next_order`): a chunk is written once
all its files were read, and its tag is the layout tag that epoch's own ORDER will
have, so a right announcement is recognisable. Otherwise the layout guesses that the
next epoch reads in this epoch's order, the best guess the daemon has, and chunks carry
the current order's tag; but where the SSD tier keeps hinted files in write-through
chunks (it can punch holes, cache/chunk_holes.py), they are in the order this epoch
fetched them already, so a guess packs nothing: the files are laid out by the order once
the job sends it again (packing the first epoch cost a cold file ~0.13 ms of CPU and a
second write, for a reuse of the same order that a shuffling sampler never makes).

Only while the next epoch will read SSD: when the RAM tier holds every file of the
hinted jobs' orders, that epoch reads RAM, and nothing is laid out for it (packing cost
a cold file ~0.3-0.5 ms more of CPU, on cores the data loader needs, for a layout only a
restarted job would read). The files stay in the write-through's chunks.

A file is packed once per layout. One already in a chunk is laid out anew (moved to a
new chunk; its old chunk is reclaimed once empty) when its chunk was laid out by another
order and either the next order is known, or its job sent the same order as the epoch
before, so the guess has proved right. Shuffled epochs without an announced next order
therefore do not rewrite the cache every epoch for a guess that is wrong. While a next
order is on its way (the epoch's ORDER said one follows, or it is being resolved), the
job's reads are held for it rather than packed in read order. Without hints nothing is
packed.

Concurrency: trio thread only; chunk files are written by the SSD tier in a worker
thread under the cache's disk limiter.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import trio

from bucketfs.cache.blocks import BlockId, ObjectRef
from bucketfs.cache.tiered import BlockCache
from bucketfs.prefetch.layout import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_SMALL_LIMIT,
    ChunkPlan,
    NextEpochPacker,
    NextPlan,
)

log = logging.getLogger(__name__)

#: How long a chunk's writer waits for a file opened but not read yet: a background
#: write, so a short wait costs nothing, and packing never GETs.
_READ_GRACE_S = 0.2

#: Complete chunks waiting to be written (keys only: the bytes are gathered when one is
#: written). Past that a chunk is not packed and its files stay block files: a disk that
#: does not keep up is not given more work.
_PACK_QUEUE = 64


def layout_tag(order: Iterable[tuple[str, int]]) -> bytes:
    """8 bytes naming an order; the chunks laid out by it carry them."""
    digest = hashlib.blake2b(digest_size=8)
    for key, _ in order:
        digest.update(key.encode("utf-8", "surrogateescape") + b"\0")
    return digest.digest()


@dataclass(slots=True)
class _JobLayout:
    packer: NextEpochPacker
    #: The tag of the order chunks are laid out for: the next one once known, else
    #: the current one.
    layout: bytes
    #: Files packed by another layout are laid out anew: the next order is known, or
    #: the job repeated its order.
    relayout: bool


class ChunkPacking:
    """Packs the small files that hinted readers read into SSD chunks (module
    docstring). Trio thread only."""

    def __init__(self, cache: BlockCache, objects: dict[str, ObjectRef],
                 block_size: int) -> None:
        self.cache = cache
        self.objects = objects
        # A packed file is one cache entry (one block).
        self.small_limit = min(DEFAULT_SMALL_LIMIT, block_size + 1)
        self.jobs: dict[Hashable, _JobLayout] = {}
        self._last_layout: dict[Hashable, bytes] = {}
        #: The bytes of each job's current order: while the RAM tier holds them all, the
        #: next epoch reads RAM, not SSD, and nothing is laid out (`_ram_serves_next`).
        self._order_bytes: dict[Hashable, int] = {}
        self._send, self._receive = trio.open_memory_channel[
            tuple[ChunkPlan, bytes, tuple[ObjectRef | None, ...]]](_PACK_QUEUE)
        self.chunks_written = 0
        self.chunks_skipped = 0

    def new_order(self, job: Hashable, layout: bytes, *, order_bytes: int,
                  expect_next: bool = False) -> None:
        """A new epoch for `job`, whose order reads `order_bytes`: what its last epoch
        read and did not pack yet is packed now; this epoch's reads go into a new
        layout. `expect_next`: the job said its next order follows: its reads are held
        for it."""
        self.end(job)
        relayout = self._last_layout.get(job) == layout
        self._last_layout[job] = layout
        self._order_bytes[job] = order_bytes
        packer = NextEpochPacker(chunk_bytes=DEFAULT_CHUNK_BYTES, small_limit=self.small_limit)
        self.jobs[job] = _JobLayout(packer, layout, relayout)
        if expect_next:
            packer.expect_next()

    def expect_next(self, job: Hashable) -> None:
        """`job` announced its next order, which is being resolved: hold its reads for
        it rather than packing them in read order."""
        state = self.jobs.get(job)
        if state is not None:
            state.packer.expect_next()

    def plan_next(self, order: list[tuple[str, int]]) -> tuple[NextPlan, bytes]:
        """The layout of a next order ((key, size) pairs) and its tag. Touches nothing
        shared: run it in a worker thread (a million keys take seconds)."""
        packer = NextEpochPacker(chunk_bytes=DEFAULT_CHUNK_BYTES, small_limit=self.small_limit)
        return packer.plan(order), layout_tag(order)

    def next_order(self, job: Hashable, plan: NextPlan, layout: bytes) -> None:
        """`job`'s next order is known (`plan_next`): what it reads from now on is laid
        out in it, and files already packed by another layout are laid out anew."""
        state = self.jobs.get(job)
        if state is None:
            return
        packer = state.packer
        # Held while the plan was on its way: some may be where it wants them already.
        settled = [key for key in packer.waiting() if self._layout_of(key) == layout]
        state.layout, state.relayout = layout, True
        chunks = packer.use(plan, settled=settled)
        if not self._ram_serves_next():  # else what was held is not laid out either
            self._queue(chunks, layout)

    def end(self, job: Hashable, *, forget: bool = False) -> None:
        state = self.jobs.pop(job, None)
        if state is not None and not self._ram_serves_next():
            self._queue(state.packer.flush(), state.layout)
        if forget:
            self._last_layout.pop(job, None)
            self._order_bytes.pop(job, None)

    def _ram_serves_next(self) -> bool:
        """Whether the RAM tier holds every hinted job's files (their orders' bytes):
        then the next epoch is read from RAM, and laying its files out on SSD would
        only cost CPU (on a 16-core GPU node, a hinted cold epoch took 1.70 ms of daemon
        CPU per file against 1.28 without hints, most of it this packing) and a second
        write. A job restarted before that epoch reads the write-through's chunks."""
        return self.cache.keeps_in_ram(sum(self._order_bytes.values()))

    def opened(self, key: str, job: Hashable) -> None:
        """A reader of `job` opened `key`: its bytes are (about to be) in RAM."""
        state = self.jobs.get(job)
        obj = self.objects.get(key)
        if state is None or obj is None or not 0 < obj.size < self.small_limit \
                or not self.cache.packs:
            return
        if self._ram_serves_next():
            return
        packer = state.packer
        if not state.relayout and not packer.expecting and self.cache.chunks_fetched_in_order:
            # Only a guess at the next order, and the write-through's chunks hold the
            # files in the order this epoch fetched them already: nothing to gain.
            return
        layout = self.cache.packed_layout(BlockId(obj.key, obj.version, 0, size=obj.size))
        if layout is not None and not packer.expecting:  # else the next order decides
            if layout == state.layout:
                # Where this layout wants it: a planned chunk goes without it.
                self._queue(packer.settle([key]), state.layout)
                return
            if not state.relayout:
                return
        self._queue(packer.add(key, obj.size, packed=layout is not None), state.layout)

    def _layout_of(self, key: str) -> bytes | None:
        obj = self.objects.get(key)
        if obj is None:
            return None
        return self.cache.packed_layout(BlockId(obj.key, obj.version, 0, size=obj.size))

    def _queue(self, chunks: list[ChunkPlan], layout: bytes) -> None:
        for chunk in chunks:
            # The versions now: a job that ends forgets its objects before this is written.
            objs = tuple(self.objects.get(file.key) for file in chunk.files)  # type: ignore[call-overload]
            try:
                self._send.send_nowait((chunk, layout, objs))
            except trio.WouldBlock:
                self.chunks_skipped += 1

    async def run(self) -> None:
        async for chunk, layout, objs in self._receive:
            try:
                await self._write(chunk, layout, objs)
            except Exception:  # a bug here must not take the mount down
                log.exception("packing: a chunk was not written")

    async def _write(self, chunk: ChunkPlan, layout: bytes,
                     objs: tuple[ObjectRef | None, ...]) -> None:
        blocks = []
        deadline = trio.current_time() + _READ_GRACE_S
        for file, obj in zip(chunk.files, objs, strict=True):
            if obj is None or obj.size != file.length:
                continue
            block = BlockId(obj.key, obj.version, 0, size=obj.size)
            # Packing lays out what the SSD tier keeps, never decides what it keeps: a
            # file it did not store (hinted eviction keeps what readers have yet to
            # read) is left out. Never a GET of its own.
            kept = await self.cache.kept(obj, block, deadline)
            if kept is not None:
                blocks.append((block, kept.data, kept.cost))
        if blocks and await self.cache.write_chunk(blocks, layout):
            self.chunks_written += 1
