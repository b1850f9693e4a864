"""The directory tree as records in a RocksDB index, so neither the daemon's memory nor
its startup time grows with the number of objects in the bucket, and a remount reuses
the listings (and the inode numbers) of the last one without listing the bucket.

Keys, under a `space` naming the origin and the mounted prefix:

    N space \\0 parent-inode name   -> the entry's record (Record.pack)
    I space \\0 inode               -> parent-inode name (to find the entry from its inode)
    S space \\0 directory-inode     -> when the directory was listed (wall-clock seconds)
    M space \\0 next|bytes|files|stamp -> the next free inode, the totals for statfs and
                                       the next listing stamp

Entries sit under their parent sorted by name (UTF-8 byte order), so readdir is a
seek and a scan.

A listing is stored page by page as the bucket sends it (`begin`, `add_page`,
`finish`), so Python holds one page of it, not the whole directory, however large.
Every record carries the stamp of the listing that wrote it; `finish` drops the
entries an older listing left that this one did not see, then writes the `S` record:
a directory counts as listed only once all of it is stored, and a listing cut short
by a crash is made again. Each batch saves the `M` counters with its records, so the
entries such a listing left keep inode numbers and a stamp no later listing gets.

When the index cannot take writes (a full or read-only cache device), the tree goes on
in memory: the directories listed from then on, and the entries changed, are kept in
Python until unmount (one warning says so); what the index already holds is still read
from it. Blocking: point reads are cheap enough for the trio thread; the pages of a
listing are stored from a worker thread, serialised by a lock.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from rocksdict import Rdict, WriteBatch

from bucketfs.cache.scans import prefixed

log = logging.getLogger(__name__)

ROOT_INODE = 1
ENTRY = b"N"
INODE = b"I"
LISTED = b"S"
META = b"M"
_U64 = struct.Struct(">Q")
_FIXED = struct.Struct("<QBQqQ")  # inode, is_dir, size, mtime_ns, listing stamp


def _text(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogateescape")
    return struct.pack("<I", len(raw)) + raw


@dataclass(slots=True)
class Record:
    """One directory entry as stored (see namespace.Node for the meaning of fields)."""

    inode: int
    is_dir: bool
    key: str
    size: int = 0
    mtime_ns: int = 0
    version: str = ""
    #: The listing that wrote it (TreeIndex.finish drops entries of older listings).
    stamp: int = 0

    def pack(self) -> bytes:
        return (_FIXED.pack(self.inode, self.is_dir, self.size, self.mtime_ns, self.stamp)
                + _text(self.key) + _text(self.version))

    @classmethod
    def unpack(cls, raw: bytes) -> Record:
        inode, is_dir, size, mtime_ns, stamp = _FIXED.unpack_from(raw)
        at, texts = _FIXED.size, []
        for _ in range(2):
            (length,) = struct.unpack_from("<I", raw, at)
            texts.append(raw[at + 4:at + 4 + length].decode("utf-8", "surrogateescape"))
            at += 4 + length
        return cls(inode, bool(is_dir), texts[0], size, mtime_ns, texts[1], stamp)

    def same_object(self, other: Record | Child) -> bool:
        """Whether `other` names the same directory, or the same version of the file: an
        inode stands for one version, so the kernel never mixes two in its page cache."""
        return self.is_dir == other.is_dir and (self.is_dir or self.version == other.version)


@dataclass(slots=True)
class Child:
    """One entry of a new listing, before it has an inode."""

    name: str
    is_dir: bool
    key: str
    size: int = 0
    mtime_ns: int = 0
    version: str = ""


@dataclass(slots=True)
class Listing:
    """A listing of one directory being stored."""

    parent: int
    stamp: int
    #: Stored in memory (the index took no writes when it began).
    in_memory: bool
    #: In memory: the directory's entries as this listing sees them.
    entries: dict[str, Record] = field(default_factory=dict)


@dataclass(slots=True)
class _Counts:
    """Changes to the statfs totals a batch makes."""

    files: int = 0
    bytes: int = 0

    def add(self, record: Record, sign: int) -> None:
        self.files += sign
        self.bytes += sign * record.size


@dataclass(slots=True)
class Changes:
    """What storing (part of) a listing changed that others must hear of."""

    #: Keys of objects hidden by a directory of the same name.
    hidden: list[str] = field(default_factory=list)
    #: Entries whose inode no longer names them (removed, or a new version of the file
    #: under a new inode): (name, the record they had).
    gone: list[tuple[str, Record]] = field(default_factory=list)


#: In `_Memory.changed`: the entry was removed (the index still holds it).
_REMOVED = Record(0, False, "")


class IndexUnwritable(Exception):
    """The index refused a write during a listing: list the directory again (it will be
    kept in memory)."""


@dataclass(slots=True)
class _Memory:
    """What the tree holds in memory since the index stopped taking writes."""

    #: Directories listed since: their whole listing, and when it was made.
    listings: dict[int, dict[str, Record]] = field(default_factory=dict)
    listed_at: dict[int, float] = field(default_factory=dict)
    #: Entries changed since in directories the index holds: (parent, name) -> record.
    changed: dict[tuple[int, str], Record] = field(default_factory=dict)
    #: inode -> (parent, name) of the entries above.
    locations: dict[int, tuple[int, str]] = field(default_factory=dict)
    #: The index's listing times no longer count (a refresh that could not be saved).
    forgot_listings: bool = False


class TreeIndex:
    def __init__(self, index: Rdict, space: str) -> None:
        self.index = index
        self.space = space.encode("utf-8", "surrogateescape") + b"\0"
        self._lock = threading.Lock()
        self.next_inode = self._meta(b"next") or ROOT_INODE + 1
        self.next_stamp = self._meta(b"stamp") + 1
        self.known_bytes = self._meta(b"bytes")
        self.known_files = self._meta(b"files")
        #: False once the index refused a write: the tree goes on in `_memory`.
        self.writable = True
        self._memory = _Memory()

    # --- keys ---------------------------------------------------------------------------

    def _dir_prefix(self, parent: int) -> bytes:
        return ENTRY + self.space + _U64.pack(parent)

    def _entry_key(self, parent: int, name: str) -> bytes:
        return self._dir_prefix(parent) + name.encode("utf-8", "surrogateescape")

    def _inode_key(self, inode: int) -> bytes:
        return INODE + self.space + _U64.pack(inode)

    def _listed_key(self, inode: int) -> bytes:
        return LISTED + self.space + _U64.pack(inode)

    def _meta(self, name: bytes) -> int:
        raw = self.index.get(META + self.space + name)
        return _U64.unpack(raw)[0] if raw else 0

    # --- reads --------------------------------------------------------------------------

    def child(self, parent: int, name: str) -> Record | None:
        memory = self._memory
        if parent in memory.listings:
            return memory.listings[parent].get(name)
        changed = memory.changed.get((parent, name))
        if changed is not None:
            return None if changed is _REMOVED else changed
        return self._stored_child(parent, name)

    def _stored_child(self, parent: int, name: str) -> Record | None:
        raw = self.index.get(self._entry_key(parent, name))
        return None if raw is None else Record.unpack(raw)

    def locate(self, inode: int) -> tuple[int, str] | None:
        """(parent inode, name) of an inode, or None if no listing holds it."""
        where = self._memory.locations.get(inode)
        if where is not None:
            return where
        raw = self.index.get(self._inode_key(inode))
        if raw is None:
            return None
        return _U64.unpack_from(raw)[0], raw[8:].decode("utf-8", "surrogateescape")

    def listed_at(self, inode: int) -> float | None:
        memory = self._memory
        if inode in memory.listed_at:
            return memory.listed_at[inode]
        if memory.forgot_listings:
            return None
        raw = self.index.get(self._listed_key(inode))
        return None if raw is None else struct.unpack("<d", raw)[0]

    def children(self, parent: int, after: str | None = None) -> Iterator[tuple[str, Record]]:
        """(name, record) of a directory's entries in name order, from the first name
        after `after` (readdir resumes there)."""
        memory = self._memory
        if parent in memory.listings:
            entries = memory.listings[parent]
            key = lambda name: name.encode("utf-8", "surrogateescape")  # noqa: E731
            for name in sorted(entries, key=key):
                if after is None or key(name) > key(after):
                    yield name, entries[name]
            return
        prefix = self._dir_prefix(parent)
        start = None if after is None else self._entry_key(parent, after) + b"\0"
        for raw_key, value in prefixed(self.index, prefix, start):
            name = raw_key[len(prefix):].decode("utf-8", "surrogateescape")
            record = memory.changed.get((parent, name)) or Record.unpack(value)
            if record is not _REMOVED:
                yield name, record

    def any_file_key(self) -> str | None:
        """The key of one object some listing names (to probe access with a HEAD)."""
        for _, value in prefixed(self.index, ENTRY + self.space):
            record = Record.unpack(value)
            if not record.is_dir:
                return record.key
        return None

    # --- writes -------------------------------------------------------------------------

    def replace(self, parent: int, name: str, record: Record) -> Record:
        """A new version of a file (seen by a HEAD): it gets a new inode, since the
        kernel's pages of the old inode hold the old version; the record as stored."""
        with self._lock:
            old = self.child(parent, name)
            record.inode = self.next_inode
            self.next_inode += 1
            memory = self._memory
            if parent in memory.listings:
                memory.listings[parent][name] = record
            else:
                batch = WriteBatch(raw_mode=True)
                if old is not None:
                    batch.delete(self._inode_key(old.inode))
                batch.put(self._inode_key(record.inode), _U64.pack(parent)
                          + name.encode("utf-8", "surrogateescape"))
                batch.put(self._entry_key(parent, name), record.pack())
                # With the record: a crash must not hand out its inode again.
                batch.put(META + self.space + b"next", _U64.pack(self.next_inode))
                if not self._try_write(batch):
                    memory.changed[(parent, name)] = record
            if old is not None:
                memory.locations.pop(old.inode, None)
                self._count(old, -1)
            memory.locations[record.inode] = (parent, name)
            self._count(record, 1)
            return record

    def remove(self, parent: int, name: str) -> Record | None:
        """The object was deleted from the bucket: its entry goes (its record)."""
        with self._lock:
            old = self.child(parent, name)
            if old is None:
                return None
            memory = self._memory
            memory.locations.pop(old.inode, None)
            if parent in memory.listings:
                memory.listings[parent].pop(name, None)
            else:
                batch = WriteBatch(raw_mode=True)
                batch.delete(self._inode_key(old.inode))
                batch.delete(self._entry_key(parent, name))
                if not self._try_write(batch):
                    memory.changed[(parent, name)] = _REMOVED
            self._count(old, -1)
            return old

    def _try_write(self, batch: WriteBatch) -> bool:
        """Write one change outside a listing; False if the index refused it (lock held)."""
        try:
            if not self.writable:
                raise IndexUnwritable
            self.index.write(batch)
            return True
        except Exception as exc:
            self._unwritable(exc)
            return False

    def store(self, parent: int, children: list[Child], listed_at: float) -> Changes:
        """Replace a directory's entries with a listing made in one piece."""
        listing = self.begin(parent)
        try:
            changes = self.add_page(listing, children)
            changes.gone += self.finish(listing, listed_at)
        except IndexUnwritable:  # kept in memory from now on: store it there
            listing = self.begin(parent)
            changes = self.add_page(listing, children)
            changes.gone += self.finish(listing, listed_at)
        return changes

    def begin(self, parent: int) -> Listing:
        with self._lock:
            stamp = self.next_stamp
            self.next_stamp += 1
        return Listing(parent, stamp, in_memory=not self.writable)

    def add_page(self, listing: Listing, children: list[Child]) -> Changes:
        """Store one page of a listing (in the order the bucket sent it). An entry that
        keeps its name, its kind and (a file) its version keeps its inode; one whose
        file changed gets a new inode, and the old one is `gone`. Raises
        IndexUnwritable if the index refused it."""
        with self._lock:
            if listing.in_memory:
                return self._add_in_memory(listing, children)
            batch, counts, changes = WriteBatch(raw_mode=True), _Counts(), Changes()
            written: dict[str, Record] = {}  # by this page, not in the index yet
            for child in children:
                previous = written.get(child.name) or \
                    self._stored_child(listing.parent, child.name)
                if previous is not None and previous.stamp == listing.stamp:
                    # Seen before in this listing: a repeated prefix, or an object and
                    # a directory of one name (the directory wins).
                    if previous.is_dir or not child.is_dir:
                        if previous.is_dir and not child.is_dir:
                            changes.hidden.append(child.key)
                        continue
                    changes.hidden.append(previous.key)
                record = self._record(listing, child, previous)
                if previous is not None and record.inode != previous.inode:
                    batch.delete(self._inode_key(previous.inode))
                    if previous.stamp != listing.stamp:
                        changes.gone.append((child.name, previous))
                if previous is None or record.inode != previous.inode:
                    batch.put(self._inode_key(record.inode), _U64.pack(listing.parent)
                              + child.name.encode("utf-8", "surrogateescape"))
                if previous is not None:
                    counts.add(previous, -1)
                counts.add(record, 1)
                written[child.name] = record
                batch.put(self._entry_key(listing.parent, child.name), record.pack())
            self._write(batch, counts)
            return changes

    def _record(self, listing: Listing, child: Child, previous: Record | None) -> Record:
        """The record of a listed entry; lock held."""
        if previous is not None and previous.same_object(child):
            inode = previous.inode
        else:
            inode = self.next_inode
            self.next_inode += 1
        return Record(inode, child.is_dir, child.key, child.size, child.mtime_ns,
                      child.version, listing.stamp)

    def _add_in_memory(self, listing: Listing, children: list[Child]) -> Changes:
        changes = Changes()
        for child in children:
            previous = listing.entries.get(child.name)
            if previous is not None:
                if previous.is_dir or not child.is_dir:
                    if previous.is_dir and not child.is_dir:
                        changes.hidden.append(child.key)
                    continue
                changes.hidden.append(previous.key)
            else:  # keep the inode the index or an earlier listing gave it
                previous = self.child(listing.parent, child.name)
            listing.entries[child.name] = self._record(listing, child, previous)
        return changes

    def finish(self, listing: Listing, listed_at: float) -> list[tuple[str, Record]]:
        """The last page was stored: drop what the listing did not see, and count the
        directory as listed; the entries that went (name, record). Raises
        IndexUnwritable if the index refused it."""
        with self._lock:
            if listing.in_memory:
                return self._finish_in_memory(listing, listed_at)
            batch, counts, gone = WriteBatch(raw_mode=True), _Counts(), []
            prefix = self._dir_prefix(listing.parent)
            for key, value in prefixed(self.index, prefix):
                record = Record.unpack(value)
                if record.stamp != listing.stamp:
                    batch.delete(key)
                    batch.delete(self._inode_key(record.inode))
                    counts.add(record, -1)
                    gone.append((key[len(prefix):].decode("utf-8", "surrogateescape"),
                                 record))
                if len(batch) >= 20_000:
                    self._write(batch, counts)
                    batch, counts = WriteBatch(raw_mode=True), _Counts()
            # Last: the directory counts as listed only once all of it is stored.
            batch.put(self._listed_key(listing.parent), struct.pack("<d", listed_at))
            self._write(batch, counts)
            return gone

    def _finish_in_memory(self, listing: Listing, listed_at: float,
                          ) -> list[tuple[str, Record]]:
        memory = self._memory
        parent = listing.parent
        before = memory.listings.get(parent)
        if before is None:
            before = {name: record for name, record in self.children(parent)}
        for record in before.values():
            self._count(record, -1)
            memory.locations.pop(record.inode, None)
        for name, record in listing.entries.items():
            self._count(record, 1)
            memory.locations[record.inode] = (parent, name)
            memory.changed.pop((parent, name), None)
        memory.listings[parent] = listing.entries
        memory.listed_at[parent] = listed_at
        return [(name, record) for name, record in before.items()
                if (now := listing.entries.get(name)) is None or now.inode != record.inode]

    def _write(self, batch: WriteBatch, counts: _Counts) -> None:
        """Write a batch of a listing; its changes to the totals count once written.
        Each batch saves the counters with its records: a mount killed between two
        pages must not hand out again the inodes or the stamp those records carry."""
        try:
            if not self.writable:
                raise IndexUnwritable
            for name, value in ((b"next", self.next_inode),
                                (b"bytes", self.known_bytes + counts.bytes),
                                (b"files", self.known_files + counts.files),
                                (b"stamp", self.next_stamp)):
                batch.put(META + self.space + name, _U64.pack(max(value, 0)))
            self.index.write(batch)
        except Exception as exc:
            self._unwritable(exc)
            raise IndexUnwritable from None
        self.known_files += counts.files
        self.known_bytes += counts.bytes

    def _unwritable(self, exc: BaseException) -> None:
        if self.writable:
            self.writable = False
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("the index cannot take writes (%s): directory listings are kept in "
                        "memory until unmount; reads go on", reason)

    def _count(self, record: Record, sign: int) -> None:
        self.known_files += sign
        self.known_bytes += sign * record.size

    def forget_listings(self) -> None:
        """Every directory must be listed again (mount --refresh); inodes are kept."""
        try:
            if not self.writable:
                raise IndexUnwritable
            self.index.delete_range(LISTED + self.space, LISTED + self.space[:-1] + b"\1")
        except Exception as exc:
            self._unwritable(exc)
            self._memory.forgot_listings = True
        self._memory.listed_at.clear()
