"""Chunk files on the SSD tier: small files packed in the order they will be read.

After LCache (../shared/seeds/003_*): reading thousands of ~100 KB files one by one is
random I/O and one open per file; the same bytes laid out in chunks of a few MiB in
read order come back in large sequential reads. The daemon's packer
(`bucketfs/prefetcher.py`, planning in `prefetch/packing.py`) decides which files go
together and hands their bytes to `ChunkStore.write`; this module stores, reads, evicts
and recovers chunks. Without hints nothing is packed: every entry is a block file.

On disk, `cache_dir/chunks/<id:016x>.chk`: a header (magic, chunk id, data length)
padded to `DATA_START`, then the members' bytes back to back. Ids grow and a running
tier never reuses one, so an open file descriptor can never name another chunk.

In the index (the RocksDB of disk.py):

    E + entry  a packed entry: b"P", chunk id, offset, length, CRC32, refetch cost and
               the layout tag of its chunk (45 bytes; a block-file record is 20 + 8k
               bytes, so the two kinds never clash and a lookup stays one point read)
    K + id     the chunk: data bytes, live bytes, cost, eviction state, and its member
               table (entry, offset, length, CRC32, cost) for read-ahead and eviction
    R/T keys   the chunk's place in the eviction order (ranking.py), named
               "\\0chunk\\0" + id, which no entry name (bucket URL first) can be

Eviction ranks and evicts whole chunks. A chunk is one entry of the tier's policy: its
size is its data bytes, its refetch cost the sum of its members', and it is referenced
whenever one of its members is read from SSD. Why whole chunks: the members of a chunk
are read together (one pread serves the rest), so they share a future; and a chunk file
is never rewritten, so evicting one member would free no space until a compactor
copied the survivors, extra writes and code for nothing the next epoch needs. One rank
key per chunk also keeps the eviction order small. The granularity (a few MiB) is
small next to an SSD budget.

Reclaiming: a member stops being live when it is packed again in another chunk (the
log laid out anew for a new order), removed, or found damaged. A chunk whose live bytes
reach zero is deleted in the same batch that took its last member. A chunk with some
dead bytes keeps them until its last member leaves or it is evicted (the budget `used`
counts a chunk's data bytes, dead ones included, until its file is gone).

Durability: the chunk file is written as `.tmp`, fsynced and renamed, then ONE
WriteBatch adds the chunk record, its rank keys and every member's record, and removes
what the members replace (their block records and rank keys, or their bytes in an
older chunk). A crash leaves either the whole chunk indexed or an unindexed file, which
the recovery scan (after an unclean close) deletes; it also drops chunk records whose
file is gone and packed records naming a missing chunk, and recounts live bytes.

Every read checks the chunk's header (magic, id) when its file is opened and each
member's CRC32: a mismatch is a miss, never wrong bytes.

Python memory: a bounded LRU of open descriptors, a bounded map of where each recently
read chunk was last read (to tell a sequential pass from a random one), the read-ahead
preads in flight (at most one per disk thread) and the last `RECENT_PASSES` done (a
few MiB each), the totals.
Nothing per entry or per chunk. Thread-safety: called from worker threads; index and
budget changes hold the tier's lock, file I/O happens outside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from rocksdict import WriteBatch

from bucketfs.cache.durable import write_durably

if TYPE_CHECKING:
    from bucketfs.cache.disk import DiskTier

log = logging.getLogger(__name__)

ENTRY = b"E"  # an entry's record (disk.py imports it from here)
CHUNK = b"K"
CHUNK_TOTALS_KEY = b"C:chunks"
RANK_NAME = b"\0chunk\0"
MAGIC = b"BFSK1\n"
_HEADER = struct.Struct("<6sQQ")  # magic, chunk id, data bytes
DATA_START = 32
_PACKED = struct.Struct("<cQQQId8s")  # b"P", chunk, offset, length, crc32, cost, layout
_CHUNK_RECORD = struct.Struct("<QqdIH")  # data bytes, live bytes, cost, members, state len
_MEMBER = struct.Struct("<QQIdH")  # offset, length, crc32, cost, entry length
_TOTALS = struct.Struct("<qqq")  # chunks, data bytes, live bytes
LAYOUT_BYTES = 8
#: Open chunk files kept (one descriptor each).
OPEN_CHUNKS = 64
#: Chunks whose last read position is remembered.
TRACKED_RUNS = 256
#: Seconds a read waits for a read-ahead pread that covers it (then reads itself).
PASS_WAIT = 30.0
#: Read-ahead preads kept after they are done (a chunk each, a few MiB).
RECENT_PASSES = 4

assert _PACKED.size % 8 != 4, "a packed record must never look like a block record"


class Packed(NamedTuple):
    """Where a packed entry's bytes are."""

    chunk: int
    offset: int
    length: int
    crc: int
    cost: float
    layout: bytes


class Member(NamedTuple):
    entry: bytes
    offset: int
    length: int
    crc: int
    cost: float


@dataclass(slots=True)
class ChunkRecord:
    size: int
    live: int
    cost: float
    state: tuple[float, ...]
    members: list[Member]


def is_packed(value: bytes) -> bool:
    return len(value) == _PACKED.size and value[:1] == b"P"


def pack_packed(p: Packed) -> bytes:
    return _PACKED.pack(b"P", p.chunk, p.offset, p.length, p.crc, p.cost, p.layout)


def parse_packed(value: bytes) -> Packed | None:
    """The packed record in `value`, or None if it is a block-file record."""
    if not is_packed(value):
        return None
    return Packed(*_PACKED.unpack(value)[1:])


def _block_record(value: bytes | None) -> bool:
    """Whether an `E` record is there and names a block file (not a packed member)."""
    return value is not None and not is_packed(value)


def chunk_key(chunk: int) -> bytes:
    return CHUNK + chunk.to_bytes(8, "big")


def rank_name(chunk: int) -> bytes:
    """The chunk's name in the eviction order."""
    return RANK_NAME + chunk.to_bytes(8, "big")


def chunk_of_rank_name(name: bytes) -> int | None:
    if not name.startswith(RANK_NAME):
        return None
    return int.from_bytes(name[len(RANK_NAME):], "big")


def encode_chunk(record: ChunkRecord) -> bytes:
    parts = [_CHUNK_RECORD.pack(record.size, record.live, record.cost, len(record.members),
                                len(record.state)),
             struct.pack(f"<{len(record.state)}d", *record.state)]
    for m in record.members:
        parts.append(_MEMBER.pack(m.offset, m.length, m.crc, m.cost, len(m.entry)))
        parts.append(m.entry)
    return b"".join(parts)


def parse_chunk(value: bytes) -> ChunkRecord:
    """Raises struct.error or ValueError on anything this code did not write."""
    size, live, cost, count, state_len = _CHUNK_RECORD.unpack_from(value)
    at = _CHUNK_RECORD.size
    state = struct.unpack_from(f"<{state_len}d", value, at)
    at += 8 * state_len
    members = []
    for _ in range(count):
        offset, length, crc, member_cost, entry_len = _MEMBER.unpack_from(value, at)
        at += _MEMBER.size
        entry = value[at:at + entry_len]
        if len(entry) != entry_len:
            raise ValueError("truncated chunk record")
        at += entry_len
        members.append(Member(entry, offset, length, crc, member_cost))
    if at != len(value):
        raise ValueError("trailing bytes in a chunk record")
    return ChunkRecord(size, live, cost, state, members)


class _Unreadable(Exception):
    """A chunk file that is missing or is not the chunk its name says."""


@dataclass(eq=False, slots=True)
class _Fd:
    fd: int
    users: int = 0
    retired: bool = False


class _OpenChunks:
    """A bounded LRU of open chunk files. A descriptor is closed only once no reader
    uses it, so a pread never meets a closed (or reused) descriptor."""

    def __init__(self, path_of: Callable[[int], Path], limit: int = OPEN_CHUNKS) -> None:
        self._path_of = path_of
        self._limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[int, _Fd] = OrderedDict()

    @contextlib.contextmanager
    def open(self, chunk: int) -> Iterator[int]:
        with self._lock:
            handle = self._open.get(chunk)
            if handle is not None:
                self._open.move_to_end(chunk)
                handle.users += 1
        if handle is None:
            handle = self._insert(chunk, self._open_checked(chunk))
        try:
            yield handle.fd
        finally:
            with self._lock:
                handle.users -= 1
                if handle.retired and handle.users == 0:
                    os.close(handle.fd)

    def _open_checked(self, chunk: int) -> int:
        try:
            fd = os.open(self._path_of(chunk), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _Unreadable("its file is missing") from None
        try:
            header = os.pread(fd, _HEADER.size, 0)
            if len(header) != _HEADER.size or _HEADER.unpack(header)[:2] != (MAGIC, chunk):
                raise _Unreadable("bad header")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _insert(self, chunk: int, fd: int) -> _Fd:
        with self._lock:
            handle = self._open.get(chunk)
            if handle is not None:  # another reader opened it meanwhile: use theirs
                os.close(fd)
            else:
                handle = self._open[chunk] = _Fd(fd)
                while len(self._open) > self._limit:
                    self._retire(self._open.popitem(last=False)[1])
            handle.users += 1
            return handle

    @staticmethod
    def _retire(handle: _Fd) -> None:  # lock held
        handle.retired = True
        if handle.users == 0:
            os.close(handle.fd)

    def forget(self, chunk: int) -> None:
        with self._lock:
            handle = self._open.pop(chunk, None)
            if handle is not None:
                self._retire(handle)

    def close(self) -> None:
        with self._lock:
            for handle in self._open.values():
                self._retire(handle)
            self._open.clear()


@dataclass(eq=False, slots=True)
class _Pass:
    """A read-ahead pread of [start, stop) of one chunk, in flight or just done."""

    start: int
    stop: int
    done: threading.Event = field(default_factory=threading.Event)
    raw: bytes | None = None


class _Passes:
    """Sequential passes over chunks. Remembers where the last read of each recently
    read chunk ended: a read at 0 or there starts or continues a pass, and reads ahead.
    Keeps the read-ahead preads in flight and the last few done: a read of a member one
    of them covers takes its bytes from there instead of reading them again. DataLoader
    workers read neighbouring files at once, and ask for the next ones before the pass's
    reader has put them in RAM."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ends: OrderedDict[int, int] = OrderedDict()
        self._inflight: dict[int, list[_Pass]] = {}
        self._recent: OrderedDict[_Pass, int] = OrderedDict()  # done pass -> its chunk

    def continues(self, chunk: int, offset: int) -> bool:
        with self._lock:
            return offset == 0 or self._ends.get(chunk) == offset

    def covering(self, chunk: int, start: int, end: int) -> _Pass | None:
        with self._lock:
            recent = [p for p, c in self._recent.items() if c == chunk]
            for shared in [*self._inflight.get(chunk, ()), *recent]:
                if shared.start <= start and end <= shared.stop:
                    return shared
        return None

    def begin(self, chunk: int, start: int, stop: int) -> _Pass:
        with self._lock:
            shared = _Pass(start, stop)
            self._inflight.setdefault(chunk, []).append(shared)
            return shared

    def finished(self, chunk: int, stop: int, shared: _Pass | None, raw: bytes | None,
                 ) -> None:
        """A read of the chunk up to `stop` ended (`raw`: its bytes, None if it failed)."""
        with self._lock:
            self._ends[chunk] = stop
            self._ends.move_to_end(chunk)
            while len(self._ends) > TRACKED_RUNS:
                self._ends.popitem(last=False)
            if shared is not None:
                others = self._inflight[chunk]
                others.remove(shared)
                if not others:
                    del self._inflight[chunk]
                shared.raw = raw
                if raw is not None:
                    self._recent[shared] = chunk
                    while len(self._recent) > RECENT_PASSES:
                        self._recent.popitem(last=False)
        if shared is not None:
            shared.done.set()

    def forget(self, chunk: int) -> None:
        with self._lock:
            self._ends.pop(chunk, None)
            for shared in [p for p, c in self._recent.items() if c == chunk]:
                del self._recent[shared]


@dataclass(slots=True)
class _Changes:
    """What a batch does to the totals and the files; applied once the batch is written."""

    freed: int = 0
    chunks: int = 0
    data: int = 0
    live: int = 0
    unlink: list[Path] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)


class ChunkStore:
    """The chunks of one SSD tier. Methods marked "lock held" expect `tier.lock`."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self.directory = tier.directory / "chunks"
        #: Chunk files, their data bytes (all counted in tier.used), their live bytes.
        self.count = 0
        self.data_bytes = 0
        self.live_bytes = 0
        #: preads of chunk files (a read-ahead pread counts once).
        self.reads = 0
        self.next_id = 0
        self._files = _OpenChunks(self.path)
        self._passes = _Passes()
        #: During a recovery scan: chunk id -> the live bytes its members add up to.
        self._recount: dict[int, int] | None = None

    def path(self, chunk: int) -> Path:
        return self.directory / f"{chunk:016x}.chk"

    # --- startup ------------------------------------------------------------------------

    def restore_totals(self, saved: bytes | None) -> None:
        """Totals saved at a clean close; none means a cache that never had chunks."""
        if saved is not None:
            self.count, self.data_bytes, self.live_bytes = _TOTALS.unpack(saved)
        self.next_id = self._last_id() + 1

    def totals(self) -> bytes:
        return _TOTALS.pack(self.count, self.data_bytes, self.live_bytes)

    def _last_id(self) -> int:
        it = self.tier.index.iter()
        it.seek_for_prev(CHUNK + b"\xff" * 9)
        if it.valid() and it.key().startswith(CHUNK) and len(it.key()) == 9:
            return int.from_bytes(it.key()[1:], "big")
        return -1

    def recover_chunks(self, rebuild: bool) -> None:
        """Recovery, step 1 (before the entries are scanned): count the chunk records
        whose file exists, restore their ranks (written anew if `rebuild`), drop the
        records whose file is gone."""
        index, ranking = self.tier.index, self.tier.ranking
        batch = WriteBatch(raw_mode=True) if rebuild else None
        present = set(os.listdir(self.directory)) if self.directory.is_dir() else set()
        self._recount = {}
        lost: list[tuple[bytes, ChunkRecord | None]] = []
        for key, value in index.items(from_key=CHUNK):
            if not key.startswith(CHUNK):
                break
            chunk = int.from_bytes(key[1:], "big")
            try:
                record = parse_chunk(value)
            except (ValueError, struct.error):
                lost.append((key, None))
                continue
            ranking.restored(batch, rank_name(chunk), record.size, record.cost, record.state)
            if self.path(chunk).name not in present:
                lost.append((key, record))
                continue
            self._recount[chunk] = 0
            self.count += 1
            self.data_bytes += record.size
            self.tier.used += record.size
        drop = WriteBatch(raw_mode=True)
        for key, record in lost:  # their members' records are dropped by the entry scan
            drop.delete(key)
            if record is not None:
                ranking.removed(drop, rank_name(int.from_bytes(key[1:], "big")),
                                record.size, record.cost, record.state)
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
        index = self.tier.index
        recount, self._recount = self._recount, None
        for chunk, live in recount.items():
            key = chunk_key(chunk)
            record = parse_chunk(index[key])
            if live == 0:  # not counted in live_bytes: nothing to take off
                record.live = 0
                batch, changes = WriteBatch(raw_mode=True), _Changes()
                self._drop_into(batch, chunk, record, changes)
                index.write(batch)
                self._apply(changes)
                continue
            if record.live != live:
                record.live = live
                index[key] = encode_chunk(record)
            self.live_bytes += live
        self.next_id = self._last_id() + 1
        self._sweep({self.path(chunk).name for chunk in recount})

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

    # --- reads --------------------------------------------------------------------------

    def read(self, entry: bytes, packed: Packed, ahead: int,
             ) -> tuple[bytes, list[tuple[Member, bytes]]] | None:
        """A packed entry's bytes, or None (a miss). With `ahead` > 0 and a read that
        starts or continues a pass over the chunk, the members after it (up to `ahead`
        bytes) come in the same pread, each checked against its CRC32."""
        tier = self.tier
        value = tier.index.get(chunk_key(packed.chunk))
        record = None if value is None else self._parsed(value)
        if record is None:
            with tier.lock:
                self.forget_member(entry, packed)
            return None
        start, end = packed.offset, packed.offset + packed.length
        shared = self._passes.covering(packed.chunk, start, end)
        if shared is not None and shared.done.wait(PASS_WAIT) and shared.raw is not None:
            data = shared.raw[start - shared.start:end - shared.start]
            if len(data) == packed.length and zlib.crc32(data) == packed.crc:
                return data, []  # its reader puts the rest in RAM
        following: list[Member] = []
        if ahead > 0 and self._passes.continues(packed.chunk, start):
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
        except (_Unreadable, OSError) as exc:
            with tier.lock:  # no record left: evicted meanwhile, nothing is wrong
                if self.drop(packed.chunk) is not None:
                    why = exc.strerror if isinstance(exc, OSError) else str(exc)
                    log.warning("cache: dropped chunk %s: %s", self.path(packed.chunk), why)
            return None
        finally:
            self._passes.finished(packed.chunk, stop, mine, raw)
        data = raw[:packed.length]
        if len(data) != packed.length or zlib.crc32(data) != packed.crc:
            log.warning("cache: a member of %s fails its checksum; treating it as a miss",
                        self.path(packed.chunk))
            with tier.lock:
                self.forget_member(entry, packed)
            return None
        ahead_read = []
        for m in following:
            member = raw[m.offset - start:m.offset - start + m.length]
            if len(member) == m.length and zlib.crc32(member) == m.crc:
                ahead_read.append((m, member))
        with tier.lock:
            self.reads += 1
            try:
                self._referenced(packed.chunk)
            except Exception as exc:  # the index cannot take writes: still a hit
                tier._step_aside(exc)
        return data, ahead_read

    def _referenced(self, chunk: int) -> None:  # lock held
        key = chunk_key(chunk)
        value = self.tier.index.get(key)
        record = None if value is None else self._parsed(value)
        if record is None:
            return
        batch = WriteBatch(raw_mode=True)
        record.state = self.tier.ranking.referenced(batch, rank_name(chunk), record.size,
                                                    record.cost, record.state)
        batch.put(key, encode_chunk(record))
        self.tier.index.write(batch)

    def member_entries(self, chunk: int) -> list[bytes]:  # lock held
        """The entries packed in `chunk` (moved-out members included); [] if unknown."""
        value = self.tier.index.get(chunk_key(chunk))
        record = None if value is None else self._parsed(value)
        return [] if record is None else [m.entry for m in record.members]

    @staticmethod
    def _parsed(value: bytes) -> ChunkRecord | None:
        try:
            return parse_chunk(value)
        except (ValueError, struct.error):
            return None

    # --- writes -------------------------------------------------------------------------

    def write(self, members: Sequence[tuple[bytes, bytes, float]], layout: bytes) -> bool:
        """Pack (entry, bytes, cost) into a new chunk, in this order, and index it. An
        entry already packed with the same `layout` tag is left where it is; one stored
        as a block file or in another chunk moves here. False if nothing was written
        (the tier steps aside, or no room)."""
        tier = self.tier
        unique: dict[bytes, tuple[bytes, float]] = {}
        for entry, data, cost in members:
            if data:
                unique.setdefault(entry, (data, cost))
        if not tier.writable or not unique:
            return False
        layout = layout.ljust(LAYOUT_BYTES, b"\0")[:LAYOUT_BYTES]
        try:
            with tier.lock:
                kept = [(e, d, c) for e, (d, c) in unique.items()
                        if not self._laid_out(e, layout)]
                size = sum(len(d) for _, d, _ in kept)
                if not kept:
                    return True
                # Members stored as block files give their room back in the batch that
                # indexes the chunk: a re-layout needs room only for what is new here,
                # and only what is new is weighed against what it would evict.
                stored = {e for e, _, _ in kept if _block_record(tier.index.get(ENTRY + e))}
                new = [(e, d) for e, d, _ in kept if e not in stored]
                incoming = [b.key for b in map(tier._block, (e for e, _ in new)) if b]
                if size > tier.capacity or (
                        new and not tier._make_room(sum(len(d) for _, d in new), incoming)):
                    return False
                chunk = self.next_id
                self.next_id += 1
                # Counted from now, so concurrent writers cannot overrun the budget.
                tier.writing[rank_name(chunk)] = size
                tier.used += size
        except Exception as exc:  # RocksDB refused a read or a delete
            tier._step_aside(exc)
            return False
        path = self.path(chunk)
        try:
            self._write_file(path, chunk, [d for _, d, _ in kept])
            with tier.lock:
                self._index(chunk, kept, layout, size)
        except Exception as exc:  # OSError from the disk, RocksDB's own errors
            with tier.lock:
                tier.used -= size
                tier.ranking.cooling.pop(rank_name(chunk), None)
            path.unlink(missing_ok=True)
            tier._step_aside(exc)
            return False
        finally:
            with tier.lock:
                tier.writing.pop(rank_name(chunk), None)
        return True

    def _laid_out(self, entry: bytes, layout: bytes) -> bool:  # lock held
        value = self.tier.index.get(ENTRY + entry)
        packed = None if value is None else parse_packed(value)
        return packed is not None and packed.layout == layout

    def _write_file(self, path: Path, chunk: int, parts: list[bytes]) -> None:
        self.directory.mkdir(exist_ok=True)
        size = sum(len(p) for p in parts)
        write_durably(path, [_HEADER.pack(MAGIC, chunk, size).ljust(DATA_START, b"\0"),
                             *parts])

    def _index(self, chunk: int, kept: list[tuple[bytes, bytes, float]], layout: bytes,
               size: int) -> None:  # lock held
        """One batch: the chunk's record and ranks, every member's record, and the
        removal of what each member replaces."""
        tier = self.tier
        batch, changes = WriteBatch(raw_mode=True), _Changes()
        moved: dict[int, int] = {}  # older chunk -> bytes of it that move here
        table: list[Member] = []
        offset = 0
        for entry, data, cost in kept:
            old = tier.index.get(ENTRY + entry)
            packed = None if old is None else parse_packed(old)
            if packed is not None:
                moved[packed.chunk] = moved.get(packed.chunk, 0) + packed.length
            elif old is not None:
                changes.freed += tier.release_block(batch, entry, old)
                changes.unlink.append(tier._path(entry))
            crc = zlib.crc32(data)
            batch.put(ENTRY + entry, pack_packed(
                Packed(chunk, offset, len(data), crc, cost, layout)))
            table.append(Member(entry, offset, len(data), crc, cost))
            offset += len(data)
        cost = sum(m.cost for m in table)
        state = tier.ranking.admitted(batch, rank_name(chunk), size, cost)
        batch.put(chunk_key(chunk), encode_chunk(ChunkRecord(size, size, cost, state, table)))
        changes.chunks, changes.data, changes.live = 1, size, size
        keep = {m.entry for m in table}
        for older, amount in moved.items():
            self._release(batch, older, amount, changes, keep)
        tier.index.write(batch)
        self._apply(changes)

    # --- reclaiming ---------------------------------------------------------------------

    def _release(self, batch: WriteBatch, chunk: int, amount: int, changes: _Changes,
                 keep: set[bytes] | frozenset[bytes] = frozenset()) -> None:  # lock held
        """`amount` bytes of `chunk` stopped being live; drop it if none are left."""
        key = chunk_key(chunk)
        value = self.tier.index.get(key)
        record = None if value is None else self._parsed(value)
        if record is None:
            return
        record.live -= amount
        changes.live -= amount
        if record.live <= 0:
            self._drop_into(batch, chunk, record, changes, keep)
        else:
            batch.put(key, encode_chunk(record))

    def _drop_into(self, batch: WriteBatch, chunk: int, record: ChunkRecord,
                   changes: _Changes, keep: set[bytes] | frozenset[bytes] = frozenset(),
                   ) -> None:  # lock held
        """Add the deletion of the chunk (record, ranks, members still in it) to `batch`;
        members named in `keep` are being given new records in the same batch."""
        index = self.tier.index
        for m in record.members:
            if m.entry in keep:
                continue
            value = index.get(ENTRY + m.entry)
            packed = None if value is None else parse_packed(value)
            if packed is not None and packed.chunk == chunk:
                batch.delete(ENTRY + m.entry)
        self.tier.ranking.removed(batch, rank_name(chunk), record.size, record.cost,
                                  record.state)
        batch.delete(chunk_key(chunk))
        changes.freed += record.size
        changes.chunks -= 1
        changes.data -= record.size
        changes.live -= max(record.live, 0)
        changes.unlink.append(self.path(chunk))
        changes.dropped.append(chunk)

    def _apply(self, changes: _Changes) -> None:  # lock held, batch written
        self.tier.used -= changes.freed
        self.count += changes.chunks
        self.data_bytes += changes.data
        self.live_bytes += changes.live
        for chunk in changes.dropped:
            self._files.forget(chunk)
            self._passes.forget(chunk)
        for path in changes.unlink:
            path.unlink(missing_ok=True)

    def drop(self, chunk: int) -> int | None:  # lock held
        """Delete a chunk and its members' records (eviction, a damaged file); its data
        bytes, or None if it had no record."""
        value = self.tier.index.get(chunk_key(chunk))
        if value is None:
            return None
        record = self._parsed(value)
        if record is None:
            self.tier.index.delete(chunk_key(chunk))
            self.path(chunk).unlink(missing_ok=True)
            return 0
        batch, changes = WriteBatch(raw_mode=True), _Changes()
        self._drop_into(batch, chunk, record, changes)
        self.tier.index.write(batch)
        self._apply(changes)
        return record.size

    def forget_member(self, entry: bytes, packed: Packed) -> int:  # lock held
        """Drop one packed entry's record if it still says `packed`; the bytes this
        frees (its chunk's, if it was the last live member)."""
        value = self.tier.index.get(ENTRY + entry)
        if value is None or parse_packed(value) != packed:
            return 0  # moved or dropped meanwhile
        batch, changes = WriteBatch(raw_mode=True), _Changes()
        batch.delete(ENTRY + entry)
        self._release(batch, packed.chunk, packed.length, changes)
        self.tier.index.write(batch)
        self._apply(changes)
        return changes.freed

    def close(self) -> None:
        self._files.close()
