"""Hits on the SSD tier: ranked at once in memory, written to the index in batches.

Why: a hit moves its entry in the eviction order, which lives in the index (ranking.py).
Written at each hit, that cost a read of the record, a rewrite of it (a chunk's record
holds its member table: kilobytes) and a RocksDB write, all under the tier's lock: a
third of the CPU of a member read from a chunk, and a seventh of the daemon's CPU per
file in an epoch read from the SSD tier (docs/BENCHMARKS.md, step 21). Now a hit computes the
entry's new state in memory (`IndexRanking.referenced_later`), and the states of every
entry hit since the last write go to the index in one batch, each record with its rank
keys:
- before the tier chooses a victim, so eviction sees the order it saw when each hit was
  written at once;
- when `PENDING_LIMIT` entries wait;
- at a clean close.

A crash loses the hits not yet written: those entries rank as if they had not been hit
since. Records and rank keys still agree, since each batch changes them together.

A record that went meanwhile (evicted, moved into a chunk, stored again) keeps what it
has: its pending hits are dropped, with the gap totals put as they would have been.

Not thread-safe: the SSD tier calls it under its lock.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

from rocksdict import Rdict, WriteBatch

from bucketfs.cache import schema
from bucketfs.cache.ranking import IndexRanking

#: Entries whose hits may wait in memory before they are written.
PENDING_LIMIT = 1024


class RecordForm(Protocol):
    """How an index record that carries an eviction state is read and rewritten."""

    def parts(self, value: bytes) -> tuple[int, float, tuple[float, ...]] | None:
        """(size, cost, state), or None if the record is not of this form."""

    def with_state(self, value: bytes, state: tuple[float, ...]) -> bytes | None:
        """The record with its state replaced; None if it cannot be rewritten."""


class BlockRecords:
    """A block file's `E` record (schema.BlockRecord)."""

    def parts(self, value: bytes) -> tuple[int, float, tuple[float, ...]] | None:
        if schema.is_packed(value):  # moved into a chunk meanwhile
            return None
        try:
            record = schema.decode_block(value)
        except (ValueError, struct.error):
            return None
        return record.length, record.cost, record.state

    def with_state(self, value: bytes, state: tuple[float, ...]) -> bytes:
        return schema.with_block_state(value, state)  # `parts` has checked the record


class ChunkRecords:
    """A chunk's `K` record: only its head is decoded; the member table is copied as
    bytes unless the state changes length (another policy's), which re-encodes it."""

    def parts(self, value: bytes) -> tuple[int, float, tuple[float, ...]] | None:
        try:
            head = schema.decode_chunk_head(value)
        except (ValueError, struct.error):
            return None
        return head.size, head.cost, head.state

    def with_state(self, value: bytes, state: tuple[float, ...]) -> bytes | None:
        spliced = schema.with_chunk_state(value, state)
        if spliced is not None:
            return spliced
        try:
            record = schema.decode_chunk(value)
        except (ValueError, struct.error):  # its head reads, its table is garbled
            return None
        record.state = state
        return schema.encode_chunk(record)


BLOCK_RECORDS = BlockRecords()
CHUNK_RECORDS = ChunkRecords()


@dataclass(slots=True)
class _Pending:
    name: bytes  # in the eviction order
    form: RecordForm
    size: int
    cost: float
    indexed: tuple[float, ...]  # the state the index holds
    now: tuple[float, ...]  # the state after the hits since


class DeferredReferences:
    def __init__(self, index: Rdict, ranking: IndexRanking,
                 limit: int = PENDING_LIMIT) -> None:
        self.index = index
        self.ranking = ranking
        self.limit = limit
        self._pending: dict[bytes, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def hit(self, key: bytes, name: bytes, form: RecordForm) -> None:
        """A hit on the record at index `key`, named `name` in the eviction order. Its
        new state waits in memory (written now if `limit` entries wait)."""
        pending = self._pending.get(key)
        if pending is None:
            value = self.index.get(key)
            parts = None if value is None else form.parts(value)
            if parts is None:  # gone meanwhile: nothing to rank
                return
            size, cost, state = parts
            pending = self._pending[key] = _Pending(name, form, size, cost, state, state)
        pending.now = self.ranking.referenced_later(pending.size, pending.cost, pending.now)
        if len(self._pending) >= self.limit:
            self.write()

    def write(self) -> None:
        """Every waiting state to the index, in one batch. Raises what RocksDB raises
        (the hits are then lost, not retried)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        batch = WriteBatch(raw_mode=True)
        for key, entry in pending.items():
            value = self.index.get(key)
            parts = None if value is None else entry.form.parts(value)
            if parts is None or parts[2] != entry.indexed:
                self.ranking.never_moved(entry.indexed, entry.now)
                continue
            updated = entry.form.with_state(value, entry.now)
            if updated is None:  # left as it is, as a hit written at once left it
                continue
            size, cost, _ = parts  # as the record says now (a chunk's may have changed)
            self.ranking.moved(batch, entry.name, size, cost, entry.indexed, entry.now)
            batch.put(key, updated)
        self.index.write(batch)
