"""Chunks on the SSD tier: small files packed in the order they will be read.

After LCache: reading thousands of ~100 KB files one by one is random I/O and one open
per file; the same bytes laid out in chunks of a few MiB in read order come back in large
sequential reads. The daemon's packer (`bucketfs/packer.py`, planning in
`prefetch/layout.py`) decides which files go together and hands their bytes to
`ChunkStore.write`; this module keeps chunks in the index (schema.py: a `K` record per
chunk with its member table, a `Packed` `E` record per member), writes, reads, evicts
and recovers them. The files themselves are chunk_files.py's.

The write-through makes chunks too (`write_through`): a batch of small blocks fetched
about together is one file in the order they came, tagged `WRITE_THROUGH` (no order
laid it out, so the packer treats its members as unpacked and moves them into a chunk
of its own layout). Creating, naming and flushing a file per ~100 KB block cost more
CPU than writing its bytes; an epoch served from SSD reads a member with one pread of
an open chunk instead of an open, a read and a close. A read of such a chunk's first
member starts no read-ahead pass (the next member is whatever was fetched next); one
that continues where the last stopped does.

Eviction ranks and evicts whole chunks. A chunk is one entry of the tier's policy: its
size is the bytes it counts in the budget, its refetch cost the sum of its members', and
it is referenced whenever one of its members is read from SSD. Why whole chunks: the
members of a chunk laid out for an order are read together (one pread serves the rest),
so they share a future, and one rank key per chunk keeps the eviction order small. The
granularity (a few MiB) is small next to an SSD budget. One exception: while hinted
orders choose what the tier keeps, the members of a write-through chunk, which were only
fetched together, are evicted one by one (disk.py), each leaving a hole (below).

Reclaiming: a member stops being live when it is packed again in another chunk (the
log laid out anew for a new order), evicted alone, removed, or found damaged. A chunk
whose live bytes reach zero is deleted in the same batch that took its last member. In
a chunk that stays, the member's bytes are punched out of the file (chunk_holes.py), and
the chunk's size, rank and cost shrink by them in that batch; where the filesystem
cannot punch holes they stay dead bytes, counted in the budget until the chunk's file
is gone.

Durability: the chunk file is written as `.tmp`, fsynced and renamed, then ONE
WriteBatch adds the chunk record, its rank keys and every member's record, and removes
what the members replace (their block records and rank keys, or their bytes in an
older chunk). A crash leaves either the whole chunk indexed or an unindexed file, which
the recovery scan (after an unclean close, chunk_recovery.py) deletes; it also drops
chunk records whose file is gone and packed records naming a missing chunk, recounts
live bytes, and punches the holes a crash left unpunched (holes are punched after the
batch that lets their members go, never before: no indexed member reads as zeros).

Every read checks the chunk's header (magic, id) when its file is opened and each
member's CRC32: a mismatch is a miss, never wrong bytes.

The room a chunk takes goes through the SSD tier's budget (`SsdSpace`, the same
reserve, write, index, roll back as a block file's). Nothing per entry or per chunk is
kept in Python. Thread-safety: called from worker threads; index and budget changes
hold the tier's lock, file I/O happens outside it.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from rocksdict import WriteBatch

from bucketfs.cache.checksum import crc32
from bucketfs.cache.chunk_files import (
    DATA_START,
    PASS_WAIT,
    ChunkUnreadable,
    OpenChunks,
    Passes,
    chunk_file_name,
    write_chunk_file,
)
from bucketfs.cache.chunk_holes import Holes
from bucketfs.cache.chunk_recovery import RecoversChunks
from bucketfs.cache.chunk_space import Admit, Decision, Reservation, SsdSpace
from bucketfs.cache.references import CHUNK_RECORDS
from bucketfs.cache.schema import (
    CHUNK,
    ENTRY,
    LAYOUT_BYTES,
    WRITE_THROUGH,
    ChunkHead,
    ChunkRecord,
    ChunkTotals,
    Member,
    Packed,
    chunk_key,
    chunk_of_key,
    chunk_rank_name,
    decode_block,
    decode_chunk,
    decode_chunk_head,
    decode_chunk_totals,
    decode_packed,
    encode_chunk,
    encode_chunk_totals,
    encode_packed,
    is_packed,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def _block_record(value: bytes | None) -> bool:
    """Whether an `E` record is there and names a block file (not a packed member)."""
    return value is not None and not is_packed(value)


@dataclass(slots=True)
class _Changes:
    """What a batch does to the totals and the files; applied once the batch is written."""

    freed: int = 0
    chunks: int = 0
    data: int = 0
    live: int = 0
    unlink: list[Path] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    #: Holes to punch once the batch is written: (chunk, its dead members' spans, bytes).
    punch: list[tuple[int, list[tuple[int, int]], int]] = field(default_factory=list)


def _decoded(decode: Callable[[bytes], T], value: bytes) -> T | None:
    """`decode(value)`, or None for a record cut short or garbled (it is then treated
    as missing)."""
    try:
        return decode(value)
    except (ValueError, struct.error):
        return None


class ChunkStore(RecoversChunks):
    """The chunks of one SSD tier. Methods marked "lock held" expect `space.lock`."""

    def __init__(self, space: SsdSpace, directory: Path) -> None:
        self.space = space
        self.directory = directory
        #: Chunk files, their data bytes (all counted in the budget), their live bytes.
        self.count = 0
        self.data_bytes = 0
        self.live_bytes = 0
        #: preads of chunk files (a read-ahead pread counts once).
        self.reads = 0
        self.next_id = 0
        self._files = OpenChunks(self.path)
        self._passes = Passes()
        self.holes = Holes(directory)
        #: During a recovery scan: chunk id -> the live bytes its members add up to.
        self._recount: dict[int, int] | None = None

    def path(self, chunk: int) -> Path:
        return self.directory / chunk_file_name(chunk)

    # --- startup ------------------------------------------------------------------------

    def restore_totals(self, saved: bytes | None) -> None:
        """Totals saved at a clean close; none means a cache that never had chunks."""
        if saved is not None:
            self.count, self.data_bytes, self.live_bytes = decode_chunk_totals(saved)
        self.next_id = self._last_id() + 1

    def totals(self) -> bytes:
        return encode_chunk_totals(ChunkTotals(self.count, self.data_bytes, self.live_bytes))

    def _last_id(self) -> int:
        it = self.space.index.iter()
        it.seek_for_prev(CHUNK + b"\xff" * 9)
        if it.valid() and it.key().startswith(CHUNK) and len(it.key()) == 9:
            return chunk_of_key(it.key())
        return -1

    # The recovery after an unclean close: chunk_recovery.py (RecoversChunks).

    # --- reads --------------------------------------------------------------------------

    def read(self, entry: bytes, packed: Packed, ahead: int,
             ) -> tuple[bytes, list[tuple[Member, bytes]]] | None:
        """A packed entry's bytes, or None (a miss). With `ahead` > 0 and a read that
        starts or continues a pass over the chunk, the members after it (up to `ahead`
        bytes) come in the same pread, each checked against its CRC32."""
        space = self.space
        value = space.index.get(chunk_key(packed.chunk))
        if value is None or self._head(value) is None:
            with space.lock:
                self.forget_member(entry, packed)
            return None
        start, end = packed.offset, packed.offset + packed.length
        shared = self._passes.covering(packed.chunk, start, end)
        if shared is not None and shared.done.wait(PASS_WAIT) and shared.raw is not None:
            data = shared.raw[start - shared.start:end - shared.start]
            if len(data) == packed.length and crc32(data) == packed.crc:
                return data, []  # its reader puts the rest in RAM
        following: list[Member] = []
        # A write-through chunk holds blocks in the order they were fetched: reading
        # its first member says nothing of the next; reading on from the last does.
        record = None
        if ahead > 0 and self._passes.continues(packed.chunk, start,
                                                from_start=packed.layout != WRITE_THROUGH):
            record = self._parsed(value)  # the member table: only to read on
        if record is not None:
            for m in record.members:  # in offset order
                if m.offset < end:
                    continue
                if m.offset + m.length - end > ahead:
                    break
                following.append(m)
        stop = following[-1].offset + following[-1].length if following else end
        mine = self._passes.begin(packed.chunk, start, stop) if following else None
        raw = None
        try:
            with self._files.open(packed.chunk) as fd:
                raw = os.pread(fd, stop - start, DATA_START + start)
        except (ChunkUnreadable, OSError) as exc:
            with space.lock:  # no record left: evicted meanwhile, nothing is wrong
                if self.drop(packed.chunk) is not None:
                    why = exc.strerror if isinstance(exc, OSError) else str(exc)
                    log.warning("cache: dropped chunk %s: %s", self.path(packed.chunk), why)
            return None
        finally:
            self._passes.finished(packed.chunk, stop, mine, raw)
        data = raw[:packed.length]
        if len(data) != packed.length or crc32(data) != packed.crc:
            with space.lock:
                value = space.index.get(ENTRY + entry)
                if value is None or decode_packed(value) != packed:
                    return None  # moved or evicted meanwhile: its hole, not damage
                log.warning("cache: a member of %s fails its checksum; treating it as a "
                            "miss", self.path(packed.chunk))
                self.forget_member(entry, packed)
            return None
        ahead_read = []
        for m in following:
            member = raw[m.offset - start:m.offset - start + m.length]
            if len(member) == m.length and crc32(member) == m.crc:
                ahead_read.append((m, member))
        with space.lock:
            self.reads += 1
            try:
                self._referenced(packed.chunk)
            except Exception as exc:  # the index cannot take writes: still a hit
                space.step_aside(exc)
        return data, ahead_read

    def _referenced(self, chunk: int) -> None:  # lock held
        self.space.references.hit(chunk_key(chunk), chunk_rank_name(chunk), CHUNK_RECORDS)

    def member_entries(self, chunk: int) -> list[bytes]:  # lock held
        """The entries packed in `chunk` (moved-out members included); [] if unknown."""
        value = self.space.index.get(chunk_key(chunk))
        record = None if value is None else self._parsed(value)
        return [] if record is None else [m.entry for m in record.members]

    @staticmethod
    def _head(value: bytes) -> ChunkHead | None:
        return _decoded(decode_chunk_head, value)

    @staticmethod
    def _parsed(value: bytes) -> ChunkRecord | None:
        return _decoded(decode_chunk, value)

    # --- writes -------------------------------------------------------------------------

    def write(self, members: Sequence[tuple[bytes, bytes, float]], layout: bytes) -> bool:
        """Pack (entry, bytes, cost) into a new chunk, in this order, and index it. An
        entry already packed with the same `layout` tag is left where it is; one stored
        as a block file or in another chunk moves here. False if nothing was written
        (the tier steps aside, or no room)."""
        layout = layout.ljust(LAYOUT_BYTES, b"\0")[:LAYOUT_BYTES]
        if layout == WRITE_THROUGH:
            raise ValueError("that layout tag is the write-through's")
        return self._write(members, layout, replace=True) is not None

    def write_through(self, members: Sequence[tuple[bytes, bytes, float]],
                      admit: Admit | None = None) -> int:
        """Store fetched blocks (entry, bytes, cost) as one chunk in the order they came
        (tagged `WRITE_THROUGH`): one file instead of one per block. An entry the tier
        holds already, in any form, is left where it is. `admit`: room is made for each
        member in turn, and one it declines is left out. How many of them the tier now
        holds (0: none, no room or the tier steps aside)."""
        return self._write(members, WRITE_THROUGH, replace=False, admit=admit) or 0

    def _write(self, members: Sequence[tuple[bytes, bytes, float]], layout: bytes, *,
               replace: bool, admit: Admit | None = None) -> int | None:
        """`write` (`replace`: move entries stored otherwise here) or `write_through`;
        how many members the tier holds afterwards, None if nothing was stored."""
        space = self.space
        unique: dict[bytes, tuple[bytes, float]] = {}
        for entry, data, cost in members:
            if data:
                unique.setdefault(entry, (data, cost))
        if not space.writable or not unique:
            return None
        chunk, kept, declined = -1, [], 0

        def decide() -> Decision:  # lock held
            nonlocal chunk, kept, declined
            if replace:
                kept = [(e, d, c) for e, (d, c) in unique.items()
                        if not self._laid_out(e, layout)]
            else:
                kept = [(e, d, c) for e, (d, c) in unique.items()
                        if space.index.get(ENTRY + e) is None]
            if admit is not None and kept:  # room made member by member, or declined
                verdicts = admit([(e, len(d)) for e, d, _ in kept])
                declined = verdicts.count(False)
                kept = [m for m, taken in zip(kept, verdicts, strict=True) if taken]
            if not kept:
                return not declined
            size = sum(len(d) for _, d, _ in kept)
            if size > space.capacity:
                return False
            # Members stored as block files, or in a chunk that punches holes, give
            # their room back in the batch that indexes the chunk: a re-layout needs
            # room only for what is new here, and only what is new is weighed against
            # what it would evict.
            stored = {e for e, _, _ in kept
                      if replace and self._gives_room_back(space.index.get(ENTRY + e))}
            new = [(e, d) for e, d, _ in kept if e not in stored]
            chunk = self.next_id
            self.next_id += 1
            if admit is not None:  # room made already, each member weighed
                return Reservation(chunk_rank_name(chunk), self.path(chunk), size, 0, ())
            return Reservation(
                chunk_rank_name(chunk), self.path(chunk), size, sum(len(d) for _, d in new),
                [b.key for b in map(space.block_of, (e for e, _ in new)) if b])

        def write(reservation: Reservation) -> None:
            self.directory.mkdir(exist_ok=True)
            write_chunk_file(reservation.path, chunk, [d for _, d, _ in kept])

        def index(reservation: Reservation) -> int:  # lock held
            if self._index(chunk, kept, layout, reservation.size, replace):
                return 0
            reservation.path.unlink(missing_ok=True)  # all stored meanwhile elsewhere
            return reservation.size

        # Stored: each member is here, or was stored meanwhile by another write.
        return len(unique) - declined if space.store(decide, write, index) else None

    def _gives_room_back(self, value: bytes | None) -> bool:  # lock held
        """Whether an entry's room comes back when it moves: a block file, or a member
        of a chunk that stays, when holes can be punched."""
        return _block_record(value) or (value is not None and self.holes.work)

    def _laid_out(self, entry: bytes, layout: bytes) -> bool:  # lock held
        value = self.space.index.get(ENTRY + entry)
        packed = None if value is None else decode_packed(value)
        return packed is not None and packed.layout == layout

    def _index(self, chunk: int, kept: list[tuple[bytes, bytes, float]], layout: bytes,
               size: int, replace: bool = True) -> int:  # lock held
        """One batch: the chunk's record and ranks, every member's record, and the
        removal of what each member replaces; without `replace`, a member stored
        meanwhile stays where it is (its bytes here are dead). How many members were
        indexed (0: none, and nothing was written to the index)."""
        space = self.space
        batch, changes = WriteBatch(raw_mode=True), _Changes()
        moved: dict[int, list[Packed]] = {}  # older chunk -> its members that move here
        table: list[Member] = []
        offset = 0
        for entry, data, cost in kept:
            old = space.index.get(ENTRY + entry)
            start, offset = offset, offset + len(data)
            if old is not None and not replace:
                continue
            packed = None if old is None else decode_packed(old)
            if packed is not None:
                moved.setdefault(packed.chunk, []).append(packed)
            elif old is not None:  # a block file: its ranks go, its room comes back
                record = decode_block(old)
                space.ranking.removed(batch, entry, record.length, record.cost,
                                      record.state)
                changes.freed += record.length
                changes.unlink.append(space.block_path(entry))
            crc = crc32(data)
            batch.put(ENTRY + entry, encode_packed(
                Packed(chunk, start, len(data), crc, cost, layout)))
            table.append(Member(entry, start, len(data), crc, cost))
        if not table:
            return 0
        live = sum(m.length for m in table)
        cost = sum(m.cost for m in table)
        state = space.ranking.admitted(batch, chunk_rank_name(chunk), size, cost)
        batch.put(chunk_key(chunk), encode_chunk(ChunkRecord(size, live, cost, state, table)))
        changes.chunks, changes.data, changes.live = 1, size, live
        keep = {m.entry for m in table}
        for older, leaving in moved.items():
            self._release(batch, older, leaving, changes, keep)
        space.index.write(batch)
        self._apply(changes)
        return len(table)

    # --- reclaiming ---------------------------------------------------------------------

    def _release(self, batch: WriteBatch, chunk: int, leaving: list[Packed],
                 changes: _Changes, keep: set[bytes] | frozenset[bytes] = frozenset(),
                 ) -> None:  # lock held
        """Members of `chunk` stopped being live: drop it if none are left, else punch
        them out of its file and shrink it by them (chunk_holes.py)."""
        key = chunk_key(chunk)
        value = self.space.index.get(key)
        record = None if value is None else self._parsed(value)
        if record is None:
            return
        amount = sum(p.length for p in leaving)
        record.live -= amount
        changes.live -= amount
        if record.live <= 0:
            self._drop_into(batch, chunk, record, changes, keep)
            return
        # Punched once the batch is written (`_apply`): punched first, a crash between
        # the two would leave members the index still names reading as zeros. A crash
        # after the batch leaves the bytes unpunched: recovery punches them.
        if self.holes.work:
            changes.punch.append((chunk, [(p.offset, p.length) for p in leaving], amount))
            self._resize(batch, chunk, record, record.size - amount,
                         max(0.0, record.cost - sum(p.cost for p in leaving)))
            changes.freed += amount
            changes.data -= amount
        batch.put(key, encode_chunk(record))

    def _holds_member(self, chunk: int, member: Member) -> bool:  # lock held
        """Whether `member` of the chunk's table still lives there (its record names the
        chunk; one that left has a record elsewhere, or none)."""
        value = self.space.index.get(ENTRY + member.entry)
        packed = None if value is None else decode_packed(value)
        return packed is not None and packed.chunk == chunk

    def _resize(self, batch: WriteBatch, chunk: int, record: ChunkRecord, size: int,
                cost: float) -> None:  # lock held
        """The chunk now counts `size` bytes and `cost`: its rank keys in `batch`, and
        `record`, which the caller puts."""
        self.space.ranking.resized(batch, chunk_rank_name(chunk), record.size, record.cost,
                                   size, cost, record.state)
        record.size, record.cost = size, cost

    def _drop_into(self, batch: WriteBatch, chunk: int, record: ChunkRecord,
                   changes: _Changes, keep: set[bytes] | frozenset[bytes] = frozenset(),
                   ) -> None:  # lock held
        """Add the deletion of the chunk (record, ranks, members still in it) to `batch`;
        members named in `keep` are being given new records in the same batch."""
        for m in record.members:
            if m.entry not in keep and self._holds_member(chunk, m):
                batch.delete(ENTRY + m.entry)
        self.space.ranking.removed(batch, chunk_rank_name(chunk), record.size, record.cost,
                                   record.state)
        batch.delete(chunk_key(chunk))
        changes.freed += record.size
        changes.chunks -= 1
        changes.data -= record.size
        changes.live -= max(record.live, 0)
        changes.unlink.append(self.path(chunk))
        changes.dropped.append(chunk)

    def _apply(self, changes: _Changes) -> None:  # lock held, batch written
        for chunk, spans, amount in changes.punch:
            if not self.holes.punch(self.path(chunk), spans):
                self._unpunched(chunk, amount)
                changes.freed -= amount
                changes.data += amount
        self.space.count_used(-changes.freed)
        self.count += changes.chunks
        self.data_bytes += changes.data
        self.live_bytes += changes.live
        for chunk in changes.dropped:
            self._files.forget(chunk)
            self._passes.forget(chunk)
        for path in changes.unlink:
            path.unlink(missing_ok=True)

    def _unpunched(self, chunk: int, amount: int) -> None:  # lock held
        """A hole counted as punched was not (the filesystem refused it): its bytes
        count in the chunk's record again (the caller counts them in the totals)."""
        value = self.space.index.get(chunk_key(chunk))
        record = None if value is None else self._parsed(value)
        if record is None:
            return
        batch = WriteBatch(raw_mode=True)
        self._resize(batch, chunk, record, record.size + amount, record.cost)
        batch.put(chunk_key(chunk), encode_chunk(record))
        self.space.index.write(batch)

    def drop(self, chunk: int) -> int | None:  # lock held
        """Delete a chunk and its members' records (eviction, a damaged file); its data
        bytes, or None if it had no record."""
        value = self.space.index.get(chunk_key(chunk))
        if value is None:
            return None
        record = self._parsed(value)
        if record is None:
            self.space.index.delete(chunk_key(chunk))
            self.path(chunk).unlink(missing_ok=True)
            return 0
        self._drop_record(chunk, record)
        return record.size

    def _drop_record(self, chunk: int, record: ChunkRecord) -> None:  # lock held
        batch, changes = WriteBatch(raw_mode=True), _Changes()
        self._drop_into(batch, chunk, record, changes)
        self.space.index.write(batch)
        self._apply(changes)

    def forget_member(self, entry: bytes, packed: Packed) -> int:  # lock held
        """Drop one packed entry's record if it still says `packed`; the bytes this
        frees (its chunk's, if it was the last live member)."""
        value = self.space.index.get(ENTRY + entry)
        if value is None or decode_packed(value) != packed:
            return 0  # moved or dropped meanwhile
        batch, changes = WriteBatch(raw_mode=True), _Changes()
        batch.delete(ENTRY + entry)
        self._release(batch, packed.chunk, [packed], changes)
        self.space.index.write(batch)
        self._apply(changes)
        return changes.freed

    def close(self) -> None:
        self._files.close()
