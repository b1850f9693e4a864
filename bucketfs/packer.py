"""Chunk packing (LCache): the small files hinted readers open, laid out in SSD chunk
files in the order they were read (bucketfs/cache/chunks.py stores them).

Each opened file of a hinted order goes to its job's `NextEpochPacker`, which cuts the
read order into chunks of about 4 MiB; a complete chunk's bytes are taken from RAM or
the write-through queue (else looked up like a read) and written by the SSD tier in a
worker thread under the cache's disk limiter. The layout guesses that the next epoch
reads in this epoch's order: the daemon learns an epoch's order only when that epoch
starts, and the current order is the best guess it has. A file is packed once; it is
laid out anew (moved to a new chunk, and its old chunk reclaimed once empty) only when
its job sent the same order as the epoch before, so the guess has proved right, and its
chunk follows another order. Shuffled epochs therefore do not rewrite the cache every
epoch for a guess that is wrong. Chunks carry the order's 8-byte fingerprint
(`layout_tag`) to tell. Without hints nothing is packed.

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
from bucketfs.prefetch.packing import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_SMALL_LIMIT,
    ChunkPlan,
    NextEpochPacker,
)

log = logging.getLogger(__name__)

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
    layout: bytes
    #: The job repeated its order: files packed by another layout are laid out anew.
    relayout: bool


class ChunkPacking:
    """Packs the small files that hinted readers read into SSD chunks (module
    docstring). Trio thread only."""

    def __init__(self, cache: BlockCache, objects: dict[str, ObjectRef],
                 block_size: int) -> None:
        assert cache.disk is not None
        self.cache = cache
        self.disk = cache.disk
        self.objects = objects
        # A packed file is one cache entry (one block).
        self.small_limit = min(DEFAULT_SMALL_LIMIT, block_size + 1)
        self.jobs: dict[Hashable, _JobLayout] = {}
        self._last_layout: dict[Hashable, bytes] = {}
        self._send, self._receive = trio.open_memory_channel[tuple[ChunkPlan, bytes]](
            _PACK_QUEUE)
        self.chunks_written = 0
        self.chunks_skipped = 0

    def new_order(self, job: Hashable, layout: bytes) -> None:
        """A new epoch for `job`: what its last epoch read and did not pack yet is
        packed now; this epoch's reads go into a new layout."""
        self.end(job)
        relayout = self._last_layout.get(job) == layout
        self._last_layout[job] = layout
        packer = NextEpochPacker(chunk_bytes=DEFAULT_CHUNK_BYTES, small_limit=self.small_limit)
        self.jobs[job] = _JobLayout(packer, layout, relayout)

    def end(self, job: Hashable, *, forget: bool = False) -> None:
        state = self.jobs.pop(job, None)
        if state is not None:
            self._queue(state.packer.flush(), state.layout)
        if forget:
            self._last_layout.pop(job, None)

    def opened(self, key: str, job: Hashable) -> None:
        """A reader of `job` opened `key`: its bytes are (about to be) in RAM."""
        state = self.jobs.get(job)
        obj = self.objects.get(key)
        if state is None or obj is None or not 0 < obj.size < self.small_limit \
                or not self.disk.writable:
            return
        layout = self.disk.packed_layout(BlockId(obj.key, obj.version, 0))
        if layout is not None and (layout == state.layout or not state.relayout):
            return
        self._queue(state.packer.add(key, obj.size), state.layout)

    def _queue(self, chunks: list[ChunkPlan], layout: bytes) -> None:
        for chunk in chunks:
            try:
                self._send.send_nowait((chunk, layout))
            except trio.WouldBlock:
                self.chunks_skipped += 1

    async def run(self) -> None:
        async for chunk, layout in self._receive:
            try:
                await self._write(chunk, layout)
            except Exception:  # a bug here must not take the mount down
                log.exception("packing: a chunk was not written")

    async def _write(self, chunk: ChunkPlan, layout: bytes) -> None:
        blocks = []
        for file in chunk.files:
            obj = self.objects.get(file.key)  # type: ignore[call-overload]
            if obj is None or obj.size != file.length:
                continue
            block = BlockId(obj.key, obj.version, 0)
            held = self.cache.held(block)
            if held is None:  # RAM let it go already: read it like a reader would
                try:
                    data = await self.cache.get(obj, 0)
                except Exception as exc:  # left out of the chunk; readers retry
                    log.debug("packing: cannot read %r: %s", obj.key, exc)
                    continue
                held = (data, self.cache.ram.costs.get(block, 0.0))
            blocks.append((block, *held))
        if blocks and await trio.to_thread.run_sync(
                self.disk.write_chunk, blocks, layout, limiter=self.cache.disk_limiter):
            self.chunks_written += 1
