"""The SSD tier: block files and chunk files under the cache directory, indexed in RocksDB.

What the write-through sends comes in batches (`put_many`): its small blocks go
together into write-through chunks (chunks.py); lone and large blocks are block files.
While hinted orders choose what the tier keeps, `HintedVictims` still decides block by
block: room is made for each member of a write-through chunk in turn, and such a member
is evicted alone, its bytes punched out of the chunk file (chunk_holes.py). Where the
filesystem cannot punch holes, hinted blocks are block files instead.

Durability, in this order, so a crash at any moment leaves nothing torn under a real
name: write `NAME.tmp`, flush (one `syncfs` for a batch of blocks, durable.py), rename
to `NAME`, then record it in the index. A block file starts with a header naming its
entry and the CRC32 of its bytes (block_files.py; a large block's file is written past
the page cache); a read checks both, so a stale, foreign or damaged file is a miss,
never wrong data.

The index (its keys and records are schema.py's) holds, per block, a record (length,
CRC, refetch cost and eviction state) and the block's place in the eviction order
(ranking.py); nothing in Python grows with the number of blocks. Small files may
instead be packed into chunk files laid out in read order (chunks.py): their record
then says where in which chunk they are, and the chunk, not the entry, has a place in
the eviction order.

Room: block files and chunks take it through one budget (`store`, and `put_many` for
a batch of blocks): under the lock, the write decides what it needs and room is made
for it (eviction, by the policy or, with hints, by `HintedVictims`), its bytes counting
from then on; the file is written outside the lock; the index is updated under it; a
failure gives the room back.

Startup (disk_open.py): a clean close saves the few totals (bytes used, the policy's
clock and gap statistics, the chunk totals), which the next open reads and deletes:
when they are missing, the last run crashed, so the open scans the records once to
recount them and deletes block and chunk files nobody indexed (a crash between rename
and index). A valid cache is never wiped; one of an older format, whose entries do not
say the span they hold, is started afresh.

A full disk (ENOSPC), a read-only or unwritable directory make the tier step aside for
writes with one warning; reads keep working from RAM and the origin. Blocking: called
from worker threads, so every mutation of shared state holds `self.lock`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from rocksdict import Rdict, WriteBatch

from bucketfs.cache import block_files, schema
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.checksum import crc32
from bucketfs.cache.chunk_space import Decision, Reservation
from bucketfs.cache.chunks import ChunkStore
from bucketfs.cache.disk_open import (
    STEP_ASIDE,
    CacheDirError,
    CacheDirUnwritable,
    OpensDirectory,
    block_file_name,
    open_error,
)
from bucketfs.cache.durable import write_many
from bucketfs.cache.file_reads import read_whole
from bucketfs.cache.hinted_victims import HintedVictims
from bucketfs.cache.index_options import index_options
from bucketfs.cache.ranking import IndexRanking
from bucketfs.cache.references import BLOCK_RECORDS, DeferredReferences
from bucketfs.cache.scans import prefixed
from bucketfs.cache.schema import ENTRY, WRITE_THROUGH, BlockRecord, Member
from bucketfs.cache.tier import Hit
from bucketfs.prefetch.eviction import RankedPolicy
from bucketfs.private import UnsafePath

log = logging.getLogger(__name__)

#: Blocks smaller than this that the write-through stores together go into one chunk
#: file of at most `WRITE_THROUGH_CHUNK` bytes: a file per ~100 KB block cost an inode,
#: a create and a rename to write, and an open and a close to read; a member of an open
#: chunk is one pread (an epoch served from SSD: -13% CPU per file, docs/BENCHMARKS.md,
#: step 11). A larger block is a file of its own.
CHUNKED_BELOW = 1 << 20
WRITE_THROUGH_CHUNK = 4 << 20

__all__ = ["CacheDirError", "CacheDirUnwritable", "DiskTier", "block_file_name"]


class DiskTier(OpensDirectory):
    name = "ssd"

    def __init__(
        self, directory: str | os.PathLike[str], capacity: int, policy: RankedPolicy, *,
        source: str, block_size: int, free_floor: int = 0, group: int | None = None,
        hinted: HintedVictims | None = None,
    ) -> None:
        """`source` names the origin (scheme, endpoint, bucket): entries of other origins
        sharing the directory stay apart. `block_size`: how this mount cuts objects.
        `group`: a group that may read the cache too (else only its owner may).
        `hinted`: chooses victims by their next use when hinted orders tell it."""
        self.directory = Path(directory)
        self.capacity = capacity
        self.free_floor = free_floor
        self.policy = policy
        self.source = source
        self.block_size = block_size
        self.hinted = hinted
        self.lock = threading.Lock()
        #: Makes stepping aside one check-and-set (it may run with `lock` held or not).
        self._aside = threading.Lock()
        #: Entries and chunks being written now (their bytes already count in `used`).
        self.writing: dict[bytes, int] = {}
        self.used = 0
        self.evictions = 0
        #: False once writes failed for a reason the disk will not fix by itself.
        self.writable = True
        self.data_dir = self.directory / "data"
        #: Subdirectories of data_dir known to exist (worker threads add to it; a set's
        #: add is atomic, and a race only makes one more mkdir).
        self._data_subdirs: set[str] = set()
        #: What the mount should tell the user about this directory.
        self.warnings: list[str] = []
        try:
            self._private_directories(group)
            # RocksDB locks its directory: a second mount on the same cache fails here.
            self.index = Rdict(str(self.directory / "index"), index_options())
        except UnsafePath as exc:
            raise CacheDirError(f"cannot use cache directory {self.directory}: {exc}") from None
        except Exception as exc:  # rocksdict raises its own exception types
            raise open_error(self.directory, exc) from None
        self.ranking = IndexRanking(self.index, policy)
        #: Hits ranked in memory, written to the index in batches (references.py).
        self.references = DeferredReferences(self.index, self.ranking)
        self.chunks = ChunkStore(self, self.directory / "chunks")
        try:
            # Before the load: a recovery punches the holes a crash left unpunched.
            self.chunks.holes.probe()
            self._load()
        except CacheDirError:
            self.index.close()
            raise
        except Exception as exc:  # a full or read-only device: RAM only
            self.index.close()
            raise open_error(self.directory, exc) from None

    # --- naming -------------------------------------------------------------------------

    def block_path(self, entry: bytes) -> Path:
        """Where the block file of `entry` is (if it is stored as one)."""
        name = block_file_name(entry)
        return self.data_dir / name[:2] / name

    def _entry(self, block: BlockId) -> bytes:
        return schema.entry_name(self.source, block, self.block_size)

    def block_of(self, entry: bytes) -> BlockId | None:
        """The block an entry names, if it is one of this origin's blocks as this mount
        cuts objects (the inverse of `_entry`)."""
        return schema.entry_block(entry, self.source, self.block_size)

    # --- reads --------------------------------------------------------------------------

    def holds(self, block: BlockId) -> bool:
        """Whether the tier has the block (one index read; no I/O)."""
        return self.index.get(ENTRY + self._entry(block)) is not None

    def get(self, block: BlockId, ahead: int = 0, *, again: bool = True) -> Hit | None:
        """The block's bytes, its refetch cost and, when the block is packed in a chunk
        that is being read in order, the blocks after it in the chunk (at most `ahead`
        bytes), read with the same pread and each checked; None on a miss."""
        entry = self._entry(block)
        value = self.index.get(ENTRY + entry)
        if value is None:
            return None
        span = schema.entry_length(entry)
        packed = schema.decode_packed(value)
        if packed is not None:
            if packed.length != span:  # not the span this read needs: never its data
                return self._mismatch(entry)
            found = self.chunks.read(entry, packed, ahead)
            if found is None:
                # Moved to another chunk while it was read (its old place punched out):
                # read it where it is now rather than fetch it again.
                moved = again and self.index.get(ENTRY + entry) not in (None, value)
                return self.get(block, ahead, again=False) if moved else None
            data, following = found
            return Hit(data, packed.cost, self._blocks_of(following))
        try:
            record = schema.decode_block(value)
        except (ValueError, struct.error):
            return self._mismatch(entry)
        if record.length != span:
            return self._mismatch(entry)
        data = self._read_verified(entry, record.length, record.crc)
        with self.lock:
            if data is None:
                now = self.index.get(ENTRY + entry)
                if now is not None and not schema.is_packed(now):  # not packed meanwhile
                    self._forget(entry)
                return None
            try:
                self._referenced(entry)
            except Exception as exc:  # the index cannot take writes: still a hit
                self.step_aside(exc)
        return Hit(data, record.cost)

    def _blocks_of(self, members: list[tuple[Member, bytes]],
                   ) -> list[tuple[BlockId, bytes, float]]:
        """The members read ahead that are blocks of this mount, whole."""
        return [(b, d, m.cost) for m, d in members
                if (b := self.block_of(m.entry)) is not None
                and len(d) == schema.entry_length(m.entry)]

    def _mismatch(self, entry: bytes) -> None:
        """A record that does not hold the span its name says: drop it, a miss."""
        log.warning("cache: %s: an index record does not match its entry's span; "
                    "dropping it", self.directory)
        with self.lock:
            value = self.index.get(ENTRY + entry)
            if value is not None and not schema.is_packed(value):
                self.block_path(entry).unlink(missing_ok=True)
            with contextlib.suppress(Exception):  # an index that takes no writes: a miss
                self._forget(entry)
        return None

    def packed_layout(self, block: BlockId) -> bytes | None:
        """The layout tag of the chunk holding the block, None if no order laid it out
        (a block file, or a write-through chunk)."""
        value = self.index.get(ENTRY + self._entry(block))
        packed = None if value is None else schema.decode_packed(value)
        return None if packed is None or packed.layout == WRITE_THROUGH else packed.layout

    def _referenced(self, entry: bytes) -> None:  # lock held
        self.references.hit(ENTRY + entry, entry, BLOCK_RECORDS)

    def _read_verified(self, entry: bytes, length: int, crc: int) -> memoryview | None:
        path = self.block_path(entry)
        try:
            raw = read_whole(path, direct=length >= block_files.LARGE)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cache: cannot read %s: %s; treating it as a miss", path, exc.strerror)
            return None
        parsed = block_files.parse(raw)
        if parsed is None:
            return self._bad(path, "bad header")
        data = parsed.data
        if (parsed.name != entry or parsed.length != length or parsed.crc != crc
                or len(data) != length):
            return self._bad(path, "names another entry or has the wrong length")
        if crc32(data) != crc:
            return self._bad(path, "checksum mismatch")
        return data

    def _bad(self, path: Path, why: str) -> None:
        log.warning("cache: dropping %s: %s", path, why)
        path.unlink(missing_ok=True)
        return None

    # --- the budget: block files and chunks take room through it -----------------------

    def store(self, decide: Callable[[], Decision], write: Callable[[Reservation], None],
              index: Callable[[Reservation], int]) -> bool:
        """Put something on the tier: under the lock `decide()` says what it needs (True:
        it is there already; False: do not store it), and room is made; `write` puts
        its file down outside the lock; `index` records it under the lock and returns
        bytes it gives back (0 unless it found it needless). A failure rolls back."""
        try:
            with self.lock:
                decision = decide()
                if isinstance(decision, bool):
                    return decision
                reservation = decision
                if reservation.room and not self._make_room(reservation.room,
                                                            reservation.incoming):
                    return False
                # Counted from now, so concurrent writers cannot overrun the budget together.
                self.writing[reservation.name] = reservation.size
                self.used += reservation.size
        except Exception as exc:  # RocksDB refused a read or a delete
            self.step_aside(exc)
            return False
        try:
            write(reservation)
            with self.lock:
                given_back = index(reservation)  # may itself change `used` (a chunk's)
                self.used -= given_back
        except Exception as exc:  # OSError from the disk, RocksDB's own errors
            with self.lock:
                self.used -= reservation.size
                self.ranking.cooling.pop(reservation.name, None)
            reservation.path.unlink(missing_ok=True)
            self.step_aside(exc)
            return False
        finally:
            with self.lock:
                self.writing.pop(reservation.name, None)
        # The room made above left out what the members moving here give back; one
        # evicted meanwhile (its chunk a victim of that very room) gave nothing and is
        # new here: evict to the budget again. What is indexed stays either way.
        try:
            with self.lock:
                if self.used > self.capacity:
                    self._make_room(0)
        except Exception as exc:  # RocksDB refused a read or a delete
            self.step_aside(exc)
        return True

    def count_used(self, size: int) -> None:
        """Bytes that came (or, negative, went) outside `store`: found at recovery,
        freed by a chunk's changes. Lock held, or at startup."""
        self.used += size

    def step_aside(self, exc: Exception) -> None:
        """A write failed: stop writing if the disk will not fix it by itself."""
        if not isinstance(exc, OSError) or exc.errno in STEP_ASIDE:
            with self._aside:  # two writers failing at once: one warning
                first, self.writable = self.writable, False
            if first:
                reason = exc.strerror if isinstance(exc, OSError) else str(exc)
                log.warning("cache: %s: the SSD tier stops taking writes (%s); reads go on "
                            "from RAM and the origin", self.directory, reason)
        else:
            log.warning("cache: cannot write a block to %s: %s", self.directory, exc)

    # --- writes -------------------------------------------------------------------------

    def put(self, block: BlockId, data: bytes, cost: float) -> bool:
        """Store a block durably; False if it was not stored (no room, tier stepped aside)."""
        return self.put_many([(block, data, cost)]) == 1

    def put_many(self, blocks: Sequence[tuple[BlockId, bytes, float]]) -> int:
        """Store blocks durably; how many are stored (already stored counts). Small
        blocks of a batch go into write-through chunks (one file and one flush for up
        to `WRITE_THROUGH_CHUNK` bytes of them; while hinted orders choose what the tier
        keeps, room is made for them one by one); the others are block files, with one
        flush of the device for all of them."""
        if not self.writable:
            return 0
        hinted = self.hinted is not None and bool(self.hinted.plans())
        if hinted and not self.chunks.holes.work:
            return self._put_files(blocks)  # its members could only leave a chunk together
        # The unmount's flush offers a block both from the write queue and from RAM.
        blocks = list({b: (b, d, c) for b, d, c in blocks}.values())
        # A chunk is evicted whole: small next to the budget.
        limit = min(WRITE_THROUGH_CHUNK, self.capacity // 16)
        groups: list[list[tuple[BlockId, bytes, float]]] = [[]]
        alone, size = [], 0
        for item in blocks:
            if len(item[1]) >= CHUNKED_BELOW:
                alone.append(item)
                continue
            if size + len(item[1]) > limit and groups[-1]:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += len(item[1])
        stored = 0
        for group in groups:
            if len(group) < 2:
                alone += group
                continue
            stored += self.chunks.write_through(self._members(group),
                                                self._admit_each if hinted else None)
        return stored + (self._put_files(alone) if alone else 0)

    def _admit_each(self, members: list[tuple[bytes, int]]) -> list[bool]:  # lock held
        """Room made for each (entry, length) in turn, as for a block file: hinted
        eviction weighs each one's next use against its victims, and declines one that
        is used later than all of them."""
        taken, verdicts = 0, []
        for entry, length in members:
            block = self.block_of(entry)
            # Room for the members taken so far too: they count from the reservation on.
            admitted = self._make_room(taken + length, [block.key] if block else [])
            verdicts.append(admitted)
            taken += length if admitted else 0
        return verdicts

    @staticmethod
    def _check_length(entry: bytes, data: bytes) -> None:
        if len(data) != schema.entry_length(entry):
            raise ValueError(f"{len(data)} bytes for a block of "
                             f"{schema.entry_length(entry)}")

    def _members(self, blocks: Sequence[tuple[BlockId, bytes, float]],
                 ) -> list[tuple[bytes, bytes, float]]:
        """(entry, bytes, cost) of blocks going into a chunk; ValueError for bytes
        that are not the block's length."""
        members = [(self._entry(b), d, c) for b, d, c in blocks]
        for entry, data, _ in members:
            self._check_length(entry, data)
        return members

    def _put_files(self, blocks: Sequence[tuple[BlockId, bytes, float]]) -> int:
        """Store blocks as block files, with one flush of the device for all of them
        (the budget's steps of `store`, for a batch)."""
        stored, planned = 0, []
        try:
            with self.lock:
                for block, data, cost in blocks:
                    entry = self._entry(block)
                    self._check_length(entry, data)
                    if entry in self.writing or self.index.get(ENTRY + entry) is not None:
                        stored += 1
                        continue
                    if len(data) > self.capacity or not self._make_room(len(data),
                                                                        [block.key]):
                        continue
                    # Counted from now, so concurrent writers cannot overrun the budget.
                    self.writing[entry] = len(data)
                    self.used += len(data)
                    planned.append((entry, data, cost, crc32(data)))
        except ValueError:
            self._give_back(planned)
            raise
        except Exception as exc:  # RocksDB refused a read or a delete
            self._give_back(planned)
            self.step_aside(exc)
            return stored
        files = []
        for entry, data, _, crc in planned:
            path = self.block_path(entry)
            if path.parent.name not in self._data_subdirs:  # one mkdir each, not per file
                path.parent.mkdir(exist_ok=True)
                self._data_subdirs.add(path.parent.name)
            files.append((path, block_files.block_file(entry, data, crc)))
        outcomes = write_many(files)
        return stored + self._index_blocks(planned, outcomes)

    def _index_blocks(self, planned: list[tuple[bytes, bytes, float, int]],
                      outcomes: list[BaseException | None]) -> int:
        """Record the block files written (one batch); give back the room of the rest."""
        with self.lock:
            batch, indexed, failed = WriteBatch(raw_mode=True), [], []
            for item, outcome in zip(planned, outcomes, strict=True):
                entry, data, cost, crc = item
                if outcome is not None:
                    failed.append(item)
                elif self.index.get(ENTRY + entry) is not None:  # packed meanwhile
                    self.block_path(entry).unlink(missing_ok=True)
                    failed.append(item)
                else:
                    state = self.ranking.admitted(batch, entry, len(data), cost)
                    batch.put(ENTRY + entry, schema.encode_block(
                        BlockRecord(len(data), crc, cost, state)))
                    indexed.append(item)
            try:
                self.index.write(batch)
            except Exception as exc:  # RocksDB's own errors: none of them is recorded
                failed += indexed
                indexed = []
                for entry, *_ in failed:
                    self.block_path(entry).unlink(missing_ok=True)
                self._give_back(failed)
                self.step_aside(exc)
                return 0
            self._give_back(failed)
            for entry, *_ in indexed:
                self.writing.pop(entry, None)
        for outcome in outcomes:
            if outcome is not None:
                self.step_aside(outcome)  # type: ignore[arg-type]
                break
        return len(indexed)

    def _give_back(self, items: Sequence[tuple[bytes, bytes, float, int]]) -> None:
        """Room reserved for blocks that are not stored after all (lock held)."""
        for entry, data, *_ in items:
            if self.writing.pop(entry, None) is not None:
                self.used -= len(data)
                self.ranking.cooling.pop(entry, None)

    def write_chunk(self, blocks: list[tuple[BlockId, bytes, float]], layout: bytes) -> bool:
        """Pack these blocks, in this order, into one chunk file (chunks.py)."""
        return self.chunks.write(self._members(blocks), layout)

    # --- eviction -----------------------------------------------------------------------

    def _make_room(self, size: int, incoming: Sequence[str] = ()) -> bool:
        """Evict until `size` more bytes fit the budget and the free-space floor. If the
        device is short of the floor by more than this tier holds, others filled it:
        evicting our blocks would not help, so nothing is evicted and nothing written."""
        shortfall = max(0, self.used + size - self.capacity, self._floor_shortfall(size))
        if shortfall > self.used:
            return False
        if shortfall > 0:
            self.references.write()  # the order as the hits left it
        while shortfall > 0:
            victim = self._victim(incoming)
            if victim is None:
                return False
            chunk = schema.chunk_of_rank_name(victim)
            length = self._forget(victim) if chunk is None else self.chunks.drop(chunk)
            if length is None:  # a rank key without a record: never written together
                log.warning("cache: %s: the eviction order names a missing entry; "
                            "dropping it", self.directory)
                if not self.ranking.victim_key:  # named by a record, not a rank key
                    return False
                self.index.delete(self.ranking.victim_key)
                continue
            if chunk is None:
                self.block_path(victim).unlink(missing_ok=True)
            self.evictions += 1
            shortfall -= length
        return True

    def _victim(self, incoming: Sequence[str]) -> bytes | None:
        """The policy's victim, or with hints the entry used farthest ahead; None when
        there is nothing to evict (with hints: nothing outside the readers' windows, or
        what comes in, the data of the objects `incoming`, is used later than anything
        here)."""
        if self.hinted is None:
            return self.ranking.victim()
        upcoming = self.hinted.nearest(incoming)
        chosen = self.hinted.choose(self.ranking.head(), self.ranking.tail(),
                                    self._keys_of, upcoming,
                                    self.hinted.behind(self._stored))
        if chosen is None:
            return None
        self.ranking.victim_key = chosen[0]
        return chosen[1]

    def _stored(self, key: str) -> list[tuple[bytes, bytes]]:
        """(rank key, name in the eviction order) of each version and block of `key`
        here: the block's entry, or the chunk it is packed in; a write-through chunk's
        member is named alone when holes can be punched (it leaves its chunk alone). The
        rank key is left empty: these names come from records that exist, so it is
        never needed."""
        found = []
        for name, value in prefixed(self.index, ENTRY + schema.entry_key_prefix(self.source,
                                                                                 key)):
            packed = schema.decode_packed(value)
            alone = packed is None or (packed.layout == WRITE_THROUGH
                                       and self.chunks.holes.work)
            found.append((b"", name[len(ENTRY):] if alone
                          else schema.chunk_rank_name(packed.chunk)))
        return found

    def _keys_of(self, name: bytes) -> list[str]:
        """The object keys a name in the eviction order holds data of (a chunk: its
        members')."""
        chunk = schema.chunk_of_rank_name(name)
        entries = [name] if chunk is None else self.chunks.member_entries(chunk)
        return [block.key for block in map(self.block_of, entries) if block is not None]

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
        packed = schema.decode_packed(value)
        if packed is not None:
            return self.chunks.forget_member(entry, packed)
        record = schema.decode_block(value)
        batch = WriteBatch(raw_mode=True)
        batch.delete(ENTRY + entry)
        self.ranking.removed(batch, entry, record.length, record.cost, record.state)
        self.index.write(batch)
        self.used -= record.length
        return record.length

    def close(self) -> None:
        with self.lock:
            try:
                ranking = self.ranking
                self.references.write()
                self.chunks.close()
                batch = WriteBatch(raw_mode=True)
                # Bytes being written are not on disk: they are not counted as used.
                batch.put(schema.STATE_KEY, schema.encode_state(schema.TierState(
                    ranking.clock, ranking.misses, self.used - sum(self.writing.values()),
                    ranking.gap_sum, ranking.gap_count)))
                batch.put(schema.CHUNK_TOTALS_KEY, self.chunks.totals())
                self.index.write(batch)
                self.index.flush()
                self.index.close()
            except Exception as exc:  # a full disk: what the WAL holds is recovered
                # Already said when the tier stepped aside: not a second warning.
                log.log(logging.WARNING if self.writable else logging.INFO,
                        "cache: could not save the index of %s on close: %s",
                        self.directory, str(exc).splitlines()[0])
