"""The SSD tier: one file per block under the cache directory, indexed in RocksDB.

Durability, in this order, so a crash at any moment leaves nothing torn under a real
name: write `NAME.tmp`, fsync, rename to `NAME`, then record it in the index. A block
file starts with a header naming its entry and the CRC32 of its bytes; a read checks
both, so a stale, foreign or damaged file is a miss, never wrong data.

The index holds, per block, a record (`E` + entry: length, CRC, refetch cost and
eviction state) and the block's place in the eviction order (ranking.py); nothing in
Python grows with the number of blocks. Small files may instead be packed into chunk
files laid out in read order (chunks.py): their `E` record then says where in which
chunk they are, and the chunk, not the entry, has a place in the eviction order.

A clean close saves the few totals (bytes used, the policy's clock and gap statistics,
the chunk totals) under `C:state` and `C:chunks`, which the next open reads and deletes:
when they are missing, the last run crashed, so the open scans the records once to
recount them and deletes block and chunk files nobody indexed (a crash between rename
and index). A valid cache is never wiped.

A full disk (ENOSPC), a read-only or unwritable directory make the tier step aside for
writes with one warning; reads keep working from RAM and the origin. Blocking: called
from worker threads, so every mutation of shared state holds `self.lock`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import stat
import struct
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path

from rocksdict import Options, Rdict, WriteBatch

from bucketfs.cache.blocks import BlockId, entry_block, entry_key_prefix, entry_length, entry_name
from bucketfs.cache.chunks import (
    CHUNK_TOTALS_KEY,
    ENTRY,
    ChunkStore,
    chunk_of_rank_name,
    parse_packed,
    rank_name,
)
from bucketfs.cache.durable import write_durably
from bucketfs.cache.foresight import HintedVictims
from bucketfs.cache.ranking import IndexRanking
from bucketfs.cache.scans import prefixed
from bucketfs.prefetch.eviction import RankedPolicy
from bucketfs.private import UnsafePath, openness, private_directory

log = logging.getLogger(__name__)

MAGIC = b"BFSB1\n"
_HEADER = struct.Struct("<IQI")  # entry-name length, data length, crc32
_RECORD = struct.Struct("<QId")  # data length, crc32, cost
CLOCK_KEY = b"C:clock"  # format 1 only
FORMAT_KEY = b"C:format"
#: 2: eviction order as index keys (ranking.py). 3: chunk files (chunks.py). 4: entries
#: and listings name their origin's endpoint, and entries the object size and the byte
#: span they hold (blocks.py). Entries of formats 1 to 3 do not say which block size cut
#: them, so such a cache is started afresh; an older build refuses a newer cache.
FORMAT = b"4"
_OLDER_FORMATS = (b"1", b"2", b"3")
STATE_KEY = b"C:state"
POLICY_KEY = b"C:policy"
_STATE = struct.Struct("<qqqqq")  # clock, miss clock, bytes used, gap sum, gap count
#: errnos that mean "this directory cannot take writes now", not a bug.
_STEP_ASIDE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


class CacheDirError(Exception):
    """The cache directory cannot be used at all (one line for the user)."""


class CacheDirUnwritable(CacheDirError):
    """The directory cannot take writes (permissions, read-only, full): the mount goes on
    with a RAM-only cache."""


def _record(length: int, crc: int, cost: float, state: tuple[float, ...]) -> bytes:
    return _RECORD.pack(length, crc, cost) + struct.pack(f"<{len(state)}d", *state)


def _parse_record(value: bytes) -> tuple[int, int, float, tuple[float, ...]]:
    length, crc, cost = _RECORD.unpack_from(value)
    rest = value[_RECORD.size:]
    return length, crc, cost, struct.unpack(f"<{len(rest) // 8}d", rest)


class DiskTier:
    def __init__(
        self, directory: str | os.PathLike[str], capacity: int, policy: RankedPolicy, *,
        source: str, block_size: int, free_floor: int = 0, group: int | None = None,
    ) -> None:
        """`source` names the origin (scheme, endpoint, bucket): entries of other origins
        sharing the directory stay apart. `block_size`: how this mount cuts objects.
        `group`: a group that may read the cache too (else only its owner may)."""
        self.directory = Path(directory)
        self.capacity = capacity
        self.free_floor = free_floor
        self.policy = policy
        self.source = source
        self.block_size = block_size
        self.lock = threading.Lock()
        #: Entries being written now (their bytes already count in `used`).
        self.writing: dict[bytes, int] = {}
        self.used = 0
        self.evictions = 0
        #: False once writes failed for a reason the disk will not fix by itself.
        self.writable = True
        self.data_dir = self.directory / "data"
        #: What the mount should tell the user about this directory.
        self.warnings: list[str] = []
        try:
            self._private_directories(group)
            # RocksDB locks its directory: a second mount on the same cache fails here.
            self.index = Rdict(str(self.directory / "index"), Options(raw_mode=True))
        except UnsafePath as exc:
            raise CacheDirError(f"cannot use cache directory {self.directory}: {exc}") from None
        except Exception as exc:  # rocksdict raises its own exception types
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            message = f"cannot use cache directory {self.directory}: {reason}"
            unwritable = (isinstance(exc, OSError) and exc.errno in _STEP_ASIDE) or any(
                s in reason for s in ("Permission denied", "Read-only file system",
                                      "No space left"))
            raise (CacheDirUnwritable if unwritable else CacheDirError)(message) from None
        self.ranking = IndexRanking(self.index, policy)
        #: Set when hinted orders tell the future: victims are then chosen by next use.
        self.foresight: HintedVictims | None = None
        self.chunks = ChunkStore(self)
        self._load()

    # --- startup ------------------------------------------------------------------------

    def _private_directories(self, group: int | None) -> None:
        """The cache holds a private bucket's bytes and key names: its directories are
        the owner's (mode 0700), or with `group` readable by it (02750: new files take
        the group). The directory the user named is left as it is, with a warning if it
        is more open; the ones inside it are ours and made private."""
        mode = 0o700 if group is None else 0o2750
        top = self.directory
        if not top.exists():
            top.parent.mkdir(parents=True, exist_ok=True)
            private_directory(top, mode, group=group)
        else:
            info = top.stat()
            if info.st_uid != os.geteuid() and info.st_mode & 0o022:
                raise UnsafePath(f"{top} belongs to uid {info.st_uid} and other users can "
                                 "write to it")
            if (opened := openness(top, mode)) is not None:
                self.warnings.append(
                    f"cache directory {top} is open to other users (mode {opened:04o}); its "
                    f"contents are kept private, but run: chmod {mode & 0o777:o} {top}")
        for sub in (self.data_dir, top / "chunks", top / "index"):
            private_directory(sub, mode, group=group)

    def _load(self) -> None:
        found = self.index.get(FORMAT_KEY)
        if found not in (None, *_OLDER_FORMATS, FORMAT):
            raise CacheDirError(f"{self.directory} holds a cache of another format; "
                                "clear it with: bucketfs cache clear DIR")
        if found in _OLDER_FORMATS:
            self._start_afresh(found)
            found = None
        identity = self.policy.identity().encode()
        # Ranks saved by another policy are rebuilt.
        rebuild = found is not None and self.index.get(POLICY_KEY) != identity
        saved = self.index.get(STATE_KEY)
        if saved is not None and len(saved) != _STATE.size:
            rebuild = True  # totals of an older layout: recount rather than misread them
        if saved is not None and not rebuild:
            (self.ranking.clock, self.ranking.misses, self.used, self.ranking.gap_sum,
             self.ranking.gap_count) = _STATE.unpack(saved)
            # Saved with the state at a clean close (absent: a format-2 cache, no chunks).
            self.chunks.restore_totals(self.index.get(CHUNK_TOTALS_KEY))
        else:
            self._recover(rebuild)
        self.index[FORMAT_KEY] = FORMAT
        self.index[POLICY_KEY] = identity
        if saved is not None:
            # From now on a crash must look like one: the next open recounts.
            batch = WriteBatch(raw_mode=True)
            batch.delete(STATE_KEY)
            batch.delete(CHUNK_TOTALS_KEY)
            self.index.write(batch)
            self.index.flush_wal(True)

    def _start_afresh(self, found: bytes) -> None:
        """Drop everything a cache of an older format holds: its entries do not say the
        span they hold, so none can be trusted to be the bytes a read needs."""
        log.warning("cache: %s was written by an older bucketfs (format %s) whose entries "
                    "do not name the block size that cut them; starting it afresh",
                    self.directory, found.decode())
        self.index.delete_range(b"\0", b"\xff" * 8)
        self.index.flush_wal(True)
        for directory in (self.data_dir, self.chunks.directory):
            mode = stat.S_IMODE(directory.stat().st_mode)
            shutil.rmtree(directory, ignore_errors=True)
            private_directory(directory, mode)

    def _recover(self, rebuild: bool) -> None:
        """Recount the records (the last run did not close cleanly, or the ranks are
        rebuilt) and delete block files no record names."""
        clock = self.index.get(CLOCK_KEY)
        if clock is not None:
            self.ranking.clock = int(struct.unpack("<d", clock)[0])
        if rebuild:
            self.ranking.clear_keys()
        self.chunks.recover_chunks(rebuild)
        batch = WriteBatch(raw_mode=True) if rebuild else None
        indexed: set[str] = set()
        broken: list[bytes] = []
        # Blocks of every bucket this directory ever cached compete for its room alike.
        for name, value in self.index.items(from_key=ENTRY):
            if not name.startswith(ENTRY):
                break
            packed = parse_packed(value)
            if packed is not None:  # counted in its chunk's bytes
                if not self.chunks.recover_member(packed):
                    broken.append(name)  # its chunk is gone
                continue
            try:
                length, _, cost, state = _parse_record(value)
                self.ranking.restored(batch, name[1:], length, cost, state)
            except (ValueError, TypeError, IndexError, OverflowError, struct.error):
                broken.append(name)  # not a record this code wrote: a miss
                continue
            indexed.add(self._file_name(name[1:]))
            self.used += length
            if batch is not None and len(batch) >= 10_000:
                self.index.write(batch)
                batch = WriteBatch(raw_mode=True)
        if batch is not None:
            self.index.write(batch)
        for name in broken:
            self.index.delete(name)
        self.chunks.finish_recovery()
        self.index.delete(CLOCK_KEY)
        self.index.delete(CHUNK_TOTALS_KEY)
        self._sweep(indexed)

    def _sweep(self, indexed: set[str]) -> None:
        """Delete temporary files and files no index entry names (a crash left them)."""
        removed = 0
        for sub in self.data_dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.name not in indexed:
                    path.unlink(missing_ok=True)
                    removed += 1
        if removed:
            log.info("cache: removed %d unindexed block files from %s", removed, self.data_dir)

    # --- naming -------------------------------------------------------------------------

    @staticmethod
    def _file_name(entry: bytes) -> str:
        return hashlib.sha256(entry).hexdigest()[:40] + ".blk"

    def _path(self, entry: bytes) -> Path:
        name = self._file_name(entry)
        return self.data_dir / name[:2] / name

    def _entry(self, block: BlockId) -> bytes:
        return entry_name(self.source, block, self.block_size)

    def _block(self, entry: bytes) -> BlockId | None:
        """The block an entry names, if it is one of this origin's blocks as this mount
        cuts objects (the inverse of `_entry`)."""
        return entry_block(entry, self.source, self.block_size)

    # --- reads --------------------------------------------------------------------------

    def __contains__(self, block: BlockId) -> bool:
        return self.index.get(ENTRY + self._entry(block)) is not None

    def get(self, block: BlockId) -> tuple[bytes, float] | None:
        """The block's bytes and its refetch cost, or None on a miss."""
        found = self.get_run(block, 0)
        return None if found is None else (found[0], found[1])

    def get_run(self, block: BlockId, ahead: int,
                ) -> tuple[bytes, float, list[tuple[BlockId, bytes, float]]] | None:
        """Like `get`, and when the block is packed in a chunk that is being read in
        order, the blocks after it in the chunk (at most `ahead` bytes), read with the
        same pread and each checked: (block, bytes, cost)."""
        entry = self._entry(block)
        value = self.index.get(ENTRY + entry)
        if value is None:
            return None
        span = entry_length(entry)
        packed = parse_packed(value)
        if packed is not None:
            if packed.length != span:  # not the span this read needs: never its data
                return self._mismatch(entry)
            found = self.chunks.read(entry, packed, ahead)
            if found is None:
                return None
            data, following = found
            return data, packed.cost, [
                (b, d, m.cost) for m, d in following
                if (b := self._block(m.entry)) is not None and len(d) == entry_length(m.entry)]
        try:
            length, crc, cost, _ = _parse_record(value)
        except (ValueError, struct.error):
            return self._mismatch(entry)
        if length != span:
            return self._mismatch(entry)
        data = self._read_verified(entry, length, crc)
        with self.lock:
            if data is None:
                now = self.index.get(ENTRY + entry)
                if now is not None and parse_packed(now) is None:  # not packed meanwhile
                    self._forget(entry)
                return None
            try:
                self._referenced(entry)
            except Exception as exc:  # the index cannot take writes: still a hit
                self._step_aside(exc)
        return data, cost, []

    def _mismatch(self, entry: bytes) -> None:
        """A record that does not hold the span its name says: drop it, a miss."""
        log.warning("cache: %s: an index record does not match its entry's span; "
                    "dropping it", self.directory)
        with self.lock:
            value = self.index.get(ENTRY + entry)
            if value is not None and parse_packed(value) is None:
                self._path(entry).unlink(missing_ok=True)
            with contextlib.suppress(Exception):  # an index that takes no writes: a miss
                self._forget(entry)
        return None

    def packed_layout(self, block: BlockId) -> bytes | None:
        """The layout tag of the chunk holding the block, None if it is not packed."""
        value = self.index.get(ENTRY + self._entry(block))
        packed = None if value is None else parse_packed(value)
        return None if packed is None else packed.layout

    def write_chunk(self, blocks: list[tuple[BlockId, bytes, float]], layout: bytes) -> bool:
        """Pack these blocks, in this order, into one chunk file (chunks.py)."""
        members = [(self._entry(b), d, c) for b, d, c in blocks]
        for entry, data, _ in members:
            if len(data) != entry_length(entry):
                raise ValueError(f"{len(data)} bytes for a block of {entry_length(entry)}")
        return self.chunks.write(members, layout)

    def _referenced(self, entry: bytes) -> None:
        # Read again under the lock: it may have been evicted or ranked anew meanwhile.
        value = self.index.get(ENTRY + entry)
        if value is None:
            return
        length, crc, cost, state = _parse_record(value)
        batch = WriteBatch(raw_mode=True)
        state = self.ranking.referenced(batch, entry, length, cost, state)
        batch.put(ENTRY + entry, _record(length, crc, cost, state))
        self.index.write(batch)

    def _read_verified(self, entry: bytes, length: int, crc: int) -> bytes | None:
        path = self._path(entry)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cache: cannot read %s: %s; treating it as a miss", path, exc.strerror)
            return None
        header_len = len(MAGIC) + _HEADER.size
        if raw[:len(MAGIC)] != MAGIC or len(raw) < header_len:
            return self._bad(path, "bad header")
        name_len, data_len, data_crc = _HEADER.unpack_from(raw, len(MAGIC))
        name = raw[header_len:header_len + name_len]
        data = raw[header_len + name_len:]
        if name != entry or data_len != length or data_crc != crc or len(data) != length:
            return self._bad(path, "names another entry or has the wrong length")
        if zlib.crc32(data) != crc:
            return self._bad(path, "checksum mismatch")
        return data

    def _bad(self, path: Path, why: str) -> None:
        log.warning("cache: dropping %s: %s", path, why)
        path.unlink(missing_ok=True)
        return None

    # --- writes -------------------------------------------------------------------------

    def put(self, block: BlockId, data: bytes, cost: float) -> bool:
        """Store a block durably; False if it was not stored (no room, tier stepped aside)."""
        entry = self._entry(block)
        if not self.writable or len(data) > self.capacity:
            return False
        if len(data) != entry_length(entry):
            raise ValueError(f"{len(data)} bytes for a block of {entry_length(entry)}")
        try:
            with self.lock:
                if entry in self.writing or self.index.get(ENTRY + entry) is not None:
                    return True
                if not self._make_room(len(data), [block.key]):
                    return False
                # Counted from now, so concurrent writers cannot overrun the budget together.
                self.writing[entry] = len(data)
                self.used += len(data)
        except Exception as exc:  # RocksDB refused a read or a delete
            self._step_aside(exc)
            return False
        crc = zlib.crc32(data)
        path = self._path(entry)
        try:
            self._write_file(path, entry, data, crc)
            with self.lock:
                if self.index.get(ENTRY + entry) is not None:  # packed in a chunk meanwhile
                    self.used -= len(data)
                    path.unlink(missing_ok=True)
                    return True
                batch = WriteBatch(raw_mode=True)
                state = self.ranking.admitted(batch, entry, len(data), cost)
                batch.put(ENTRY + entry, _record(len(data), crc, cost, state))
                self.index.write(batch)
        except Exception as exc:  # OSError from the disk, RocksDB's own errors
            with self.lock:
                self.used -= len(data)
                self.ranking.cooling.pop(entry, None)
            path.unlink(missing_ok=True)
            self._step_aside(exc)
            return False
        finally:
            with self.lock:
                self.writing.pop(entry, None)
        return True

    def _write_file(self, path: Path, entry: bytes, data: bytes, crc: int) -> None:
        path.parent.mkdir(exist_ok=True)
        write_durably(path, (MAGIC + _HEADER.pack(len(entry), len(data), crc) + entry, data))

    def _make_room(self, size: int, incoming: Sequence[str] = ()) -> bool:
        """Evict until `size` more bytes fit the budget and the free-space floor. If the
        device is short of the floor by more than this tier holds, others filled it:
        evicting our blocks would not help, so nothing is evicted and nothing written."""
        shortfall = max(0, self.used + size - self.capacity, self._floor_shortfall(size))
        if shortfall > self.used:
            return False
        while shortfall > 0:
            victim = self._victim(incoming)
            if victim is None:
                return False
            chunk = chunk_of_rank_name(victim)
            length = self._forget(victim) if chunk is None else self.chunks.drop(chunk)
            if length is None:  # a rank key without a record: never written together
                log.warning("cache: %s: the eviction order names a missing entry; "
                            "dropping it", self.directory)
                if not self.ranking.victim_key:  # named by a record, not a rank key
                    return False
                self.index.delete(self.ranking.victim_key)
                continue
            if chunk is None:
                self._path(victim).unlink(missing_ok=True)
            self.evictions += 1
            shortfall -= length
        return True

    def _victim(self, incoming: Sequence[str]) -> bytes | None:
        """The policy's victim, or with hints the entry used farthest ahead; None when
        there is nothing to evict (with hints: nothing outside the readers' windows, or
        what comes in, the data of the objects `incoming`, is used later than anything
        here)."""
        if self.foresight is None:
            return self.ranking.victim()
        future = self.foresight.future(incoming)
        chosen = self.foresight.choose(self.ranking.head(), self.ranking.tail(),
                                       self._keys_of, future,
                                       self.foresight.behind(self._stored))
        if chosen is None:
            return None
        self.ranking.victim_key = chosen[0]
        return chosen[1]

    def _stored(self, key: str) -> list[tuple[bytes, bytes]]:
        """(rank key, name in the eviction order) of each version and block of `key`
        here: the block's entry, or the chunk it is packed in. The rank key is left
        empty: these names come from records that exist, so it is never needed."""
        prefix = ENTRY + entry_key_prefix(self.source, key)
        found = []
        for name, value in prefixed(self.index, prefix):
            packed = parse_packed(value)
            found.append((b"", name[len(ENTRY):] if packed is None
                          else rank_name(packed.chunk)))
        return found

    def _keys_of(self, name: bytes) -> list[str]:
        """The object keys a name in the eviction order holds data of (a chunk: its
        members')."""
        chunk = chunk_of_rank_name(name)
        entries = [name] if chunk is None else self.chunks.member_entries(chunk)
        return [block.key for block in map(self._block, entries) if block is not None]

    def _floor_shortfall(self, size: int) -> int:
        if not self.free_floor:
            return 0
        stats = os.statvfs(self.data_dir)
        return max(0, self.free_floor - (stats.f_bavail * stats.f_frsize - size))

    def _forget(self, entry: bytes) -> int | None:
        """Drop an entry's record and ranks; its length, or None if it had no record."""
        value = self.index.get(ENTRY + entry)
        if value is None:
            return None
        packed = parse_packed(value)
        if packed is not None:
            return self.chunks.forget_member(entry, packed)
        batch = WriteBatch(raw_mode=True)
        batch.delete(ENTRY + entry)
        length = self.release_block(batch, entry, value)
        self.index.write(batch)
        self.used -= length
        return length

    def release_block(self, batch: WriteBatch, entry: bytes, value: bytes) -> int:
        """Add the removal of a block record's ranks to `batch` (the caller deletes or
        replaces the record); its length. Lock held."""
        length, _, cost, state = _parse_record(value)
        self.ranking.removed(batch, entry, length, cost, state)
        return length

    def _step_aside(self, exc: Exception) -> None:
        if not isinstance(exc, OSError) or exc.errno in _STEP_ASIDE:
            if self.writable:
                reason = exc.strerror if isinstance(exc, OSError) else str(exc)
                log.warning("cache: %s: the SSD tier stops taking writes (%s); reads go on "
                            "from RAM and the origin", self.directory, reason)
            self.writable = False
        else:
            log.warning("cache: cannot write a block to %s: %s", self.directory, exc)

    def close(self) -> None:
        with self.lock:
            try:
                ranking = self.ranking
                self.chunks.close()
                batch = WriteBatch(raw_mode=True)
                # Bytes being written are not on disk: they are not counted as used.
                batch.put(STATE_KEY, _STATE.pack(
                    ranking.clock, ranking.misses, self.used - sum(self.writing.values()),
                    ranking.gap_sum, ranking.gap_count))
                batch.put(CHUNK_TOTALS_KEY, self.chunks.totals())
                self.index.write(batch)
                self.index.flush()
                self.index.close()
            except Exception as exc:  # a full disk: what the WAL holds is recovered
                # Already said when the tier stepped aside: not a second warning.
                log.log(logging.WARNING if self.writable else logging.INFO,
                        "cache: could not save the index of %s on close: %s",
                        self.directory, str(exc).splitlines()[0])

