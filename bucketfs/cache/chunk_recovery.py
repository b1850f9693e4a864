"""Chunks after an unclean close: the recovery scan's part that concerns chunk files.

The last run stopped without saving its totals (a crash, kill -9, power loss), so the
chunk records are counted again (disk_open.py runs the steps in order): chunk records
whose file is gone are dropped, members recounted, chunks left with no live member
deleted, chunk files no record names swept away. And since a member's hole is punched
only after the batch that let it go is written (chunks.py), a run stopped between the
two left bytes the record no longer counts: they are punched here.

A mixin of ChunkStore (chunks.py), whose state and helpers it uses; it runs while the
tier opens, before any other thread uses it.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

from rocksdict import WriteBatch

from bucketfs.cache.chunk_holes import Holes
from bucketfs.cache.chunk_space import SsdSpace
from bucketfs.cache.schema import (
    CHUNK,
    ChunkRecord,
    Packed,
    chunk_key,
    chunk_of_key,
    chunk_rank_name,
    decode_chunk,
    encode_chunk,
)

log = logging.getLogger(__name__)


class RecoversChunks:
    """ChunkStore's recovery steps (a mixin: the store's __init__ sets this state)."""

    space: SsdSpace
    directory: Path
    holes: Holes
    count: int
    data_bytes: int
    live_bytes: int
    next_id: int
    #: During a recovery scan: chunk id -> the live bytes its members add up to.
    _recount: dict[int, int] | None

    # And ChunkStore's path, _last_id, _holds_member, _drop_record and _unpunched.

    def recover_chunks(self, rebuild: bool) -> None:
        """Recovery, step 1 (before the entries are scanned): count the chunk records
        whose file exists, restore their ranks (written anew if `rebuild`), drop the
        records whose file is gone."""
        index, ranking = self.space.index, self.space.ranking
        batch = WriteBatch(raw_mode=True) if rebuild else None
        present = set(os.listdir(self.directory)) if self.directory.is_dir() else set()
        self._recount = {}
        lost: list[tuple[bytes, ChunkRecord | None]] = []
        for key, value in index.items(from_key=CHUNK):
            if not key.startswith(CHUNK):
                break
            chunk = chunk_of_key(key)
            try:
                record = decode_chunk(value)
            except (ValueError, struct.error):
                lost.append((key, None))
                continue
            ranking.restored(batch, chunk_rank_name(chunk), record.size, record.cost,
                             record.state)
            if self.path(chunk).name not in present:
                lost.append((key, record))
                continue
            self._recount[chunk] = 0
            self.count += 1
            self.data_bytes += record.size
            self.space.count_used(record.size)
        drop = WriteBatch(raw_mode=True)
        for key, record in lost:  # their members' records are dropped by the entry scan
            drop.delete(key)
            if record is not None:
                ranking.removed(drop, chunk_rank_name(chunk_of_key(key)), record.size,
                                record.cost, record.state)
        if batch is not None:  # before `drop`, which deletes the lost chunks' new keys
            index.write(batch)
        index.write(drop)
        if lost:
            log.info("cache: dropped %d chunk records whose files are gone", len(lost))

    def recover_member(self, packed: Packed) -> bool:
        """Recovery, step 2, per packed record: False if its chunk is gone."""
        assert self._recount is not None
        if packed.chunk not in self._recount:
            return False
        self._recount[packed.chunk] += packed.length
        return True

    def finish_recovery(self) -> None:
        """Recovery, step 3: live bytes as the records say, empty chunks dropped,
        chunk files no record names deleted."""
        assert self._recount is not None
        index = self.space.index
        recount, self._recount = self._recount, None
        for chunk, live in recount.items():
            key = chunk_key(chunk)
            record = decode_chunk(index[key])
            if live == 0:  # not counted in live_bytes: nothing to take off
                record.live = 0
                self._drop_record(chunk, record)
                continue
            if record.live != live:
                record.live = live
                index[key] = encode_chunk(record)
            self.live_bytes += live
            written = sum(m.length for m in record.members)
            if record.size < written:
                self._punch_dead(chunk, record, written - record.size)
        self.next_id = self._last_id() + 1
        self._sweep({self.path(chunk).name for chunk in recount})

    def _punch_dead(self, chunk: int, record: ChunkRecord, unpunched: int) -> None:
        """Recovery: punch the members that left a chunk counted without them (their
        `unpunched` bytes), in case the last run stopped between the batch that let
        them go and their holes (a hole punched twice is still one hole). Where that
        fails (or holes no longer work here), the chunk counts them again."""
        dead = [(m.offset, m.length) for m in record.members
                if not self._holds_member(chunk, m)]
        if not self.holes.punch(self.path(chunk), dead):
            self._unpunched(chunk, unpunched)
            self.space.count_used(unpunched)
            self.data_bytes += unpunched

    def _sweep(self, indexed: set[str]) -> None:
        if not self.directory.is_dir():
            return
        removed = 0
        for name in os.listdir(self.directory):
            if name not in indexed:
                (self.directory / name).unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("cache: removed %d unindexed chunk files from %s", removed,
                     self.directory)
