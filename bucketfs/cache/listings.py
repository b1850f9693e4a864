"""The directory tree as records in a RocksDB index, so neither the daemon's memory nor
its startup time grows with the number of objects in the bucket, and a remount reuses
the listings (and the inode numbers) of the last one without listing the bucket.

The keys and records (`N`, `I`, `S`, `M`, under a space naming the origin and the
mounted prefix) are laid out in schema.py. Entries sit under their parent sorted by name
(UTF-8 byte order), so readdir is a seek and a scan.

A listing is stored page by page as the bucket sends it (`begin`, `add_page`,
`finish`), so Python holds one page of it, not the whole directory, however large.
Every record carries the stamp of the listing that wrote it; `finish` drops the
entries an older listing left that this one did not see, then writes the `S` record:
a directory counts as listed only once all of it is stored, and a listing cut short
by a crash is made again. Each batch saves the `M` counters with its records, so the
entries such a listing left keep inode numbers and a stamp no later listing gets.

An inode stands for one directory, or one version of a file: a file whose version
changed gets a new inode, and the old one is reported `gone`, like a removed entry.

When the index cannot take writes (a full or read-only cache device), the tree goes on
in memory: the directories listed from then on, and the entries changed, are kept in
Python until unmount (one warning says so); what the index already holds is still read
from it. Blocking: point reads are cheap enough for the trio thread; the pages of a
listing are stored from a worker thread, serialised by a lock.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from rocksdict import Rdict, WriteBatch

from bucketfs.cache import schema
from bucketfs.cache.scans import prefixed
from bucketfs.cache.schema import DirEntry

log = logging.getLogger(__name__)

ROOT_INODE = 1
_BATCH = 20_000


@dataclass(slots=True)
class Listing:
    """A listing of one directory being stored."""

    parent: int
    stamp: int
    #: Stored in memory (the index took no writes when it began).
    in_memory: bool
    #: In memory: the directory's entries as this listing sees them.
    entries: dict[str, DirEntry] = field(default_factory=dict)


@dataclass(slots=True)
class Changes:
    """What storing (part of) a listing changed that others must hear of."""

    #: Keys of objects hidden by a directory of the same name.
    hidden: list[str] = field(default_factory=list)
    #: Entries whose inode no longer names them: removed, or a new version of the file
    #: under a new inode (as they were).
    gone: list[DirEntry] = field(default_factory=list)


@dataclass(slots=True)
class _Counts:
    """Changes to the statfs totals a batch makes."""

    files: int = 0
    bytes: int = 0

    def add(self, entry: DirEntry, sign: int) -> None:
        self.files += sign
        self.bytes += sign * entry.size


#: In `_Memory.changed`: the entry was removed (the index still holds it).
_REMOVED = DirEntry("", False, "")


class IndexUnwritable(Exception):
    """The index refused a write during a listing: list the directory again (it will be
    kept in memory)."""


@dataclass(slots=True)
class _Memory:
    """What the tree holds in memory since the index stopped taking writes."""

    #: Directories listed since: their whole listing, and when it was made.
    listings: dict[int, dict[str, DirEntry]] = field(default_factory=dict)
    listed_at: dict[int, float] = field(default_factory=dict)
    #: Entries changed since in directories the index holds: (parent, name) -> entry.
    changed: dict[tuple[int, str], DirEntry] = field(default_factory=dict)
    #: inode -> (parent, name) of the entries above.
    locations: dict[int, tuple[int, str]] = field(default_factory=dict)
    #: The index's listing times no longer count (a refresh that could not be saved).
    forgot_listings: bool = False


class TreeIndex:
    def __init__(self, index: Rdict, space: bytes) -> None:
        """`space`: `schema.tree_space(origin, prefix)`, so mounts sharing an index stay
        apart."""
        self.index = index
        self.space = space
        self._lock = threading.Lock()
        self.next_inode = self._meta(b"next") or ROOT_INODE + 1
        self.next_stamp = self._meta(b"stamp") + 1
        self.known_bytes = self._meta(b"bytes")
        self.known_files = self._meta(b"files")
        #: False once the index refused a write: the tree goes on in `_memory`.
        self.writable = True
        self._memory = _Memory()

    def _meta(self, name: bytes) -> int:
        return schema.decode_counter(self.index.get(schema.tree_meta_key(self.space, name)))

    # --- reads --------------------------------------------------------------------------

    def child(self, parent: int, name: str) -> DirEntry | None:
        memory = self._memory
        if parent in memory.listings:
            return memory.listings[parent].get(name)
        changed = memory.changed.get((parent, name))
        if changed is not None:
            return None if changed is _REMOVED else changed
        return self._stored_child(parent, name)

    def _stored_child(self, parent: int, name: str) -> DirEntry | None:
        raw = self.index.get(schema.tree_entry_key(self.space, parent, name))
        return None if raw is None else schema.decode_dir_entry(raw, parent, name)

    def entry_of(self, inode: int) -> DirEntry | None:
        """The entry an inode names, or None if no listing holds it: one index read
        (the inode's record holds the entry), where two were (where, then what)."""
        memory = self._memory
        where = memory.locations.get(inode)
        if where is None:
            raw = self.index.get(schema.tree_inode_key(self.space, inode))
            if raw is None:
                return None
            try:
                entry = schema.decode_inode_record(raw, inode)
            except (ValueError, struct.error):
                return None  # not a record this code wrote
            if not (memory.changed or memory.listings):
                return entry
            # Kept in memory since the index refused writes: the index's record may
            # name an entry memory has replaced or dropped since.
            where = entry.parent, entry.name
        current = self.child(*where)
        return current if current is not None and current.inode == inode else None

    def listed_at(self, inode: int) -> float | None:
        memory = self._memory
        if inode in memory.listed_at:
            return memory.listed_at[inode]
        if memory.forgot_listings:
            return None
        raw = self.index.get(schema.tree_listed_key(self.space, inode))
        return None if raw is None else schema.decode_listed_at(raw)

    def children(self, parent: int, after: str | None = None) -> Iterator[DirEntry]:
        """A directory's entries in name order, from the first name after `after`
        (readdir resumes there)."""
        memory = self._memory
        if parent in memory.listings:
            entries = memory.listings[parent]
            key = lambda name: name.encode("utf-8", "surrogateescape")  # noqa: E731
            for name in sorted(entries, key=key):
                if after is None or key(name) > key(after):
                    yield entries[name]
            return
        prefix = schema.tree_dir_prefix(self.space, parent)
        start = None if after is None else \
            schema.tree_entry_key(self.space, parent, after) + b"\0"
        for raw_key, value in prefixed(self.index, prefix, start):
            name = raw_key[len(prefix):].decode("utf-8", "surrogateescape")
            entry = memory.changed.get((parent, name)) or \
                schema.decode_dir_entry(value, parent, name)
            if entry is not _REMOVED:
                yield entry

    def any_file_key(self) -> str | None:
        """The key of one object some listing names (to probe access with a HEAD)."""
        prefix = schema.TREE_ENTRY + self.space
        for _, value in prefixed(self.index, prefix):
            entry = schema.decode_dir_entry(value, 0, "")
            if not entry.is_dir:
                return entry.key
        return None

    # --- writes -------------------------------------------------------------------------

    def replace(self, old: DirEntry, new: DirEntry) -> DirEntry:
        """A new version of the file `old` (seen by a HEAD): it gets a new inode, since
        the kernel's pages of the old inode hold the old version; the entry as stored."""
        with self._lock:
            stored = dataclasses.replace(new, inode=self.next_inode, parent=old.parent,
                                         name=old.name, stamp=old.stamp)
            self.next_inode += 1
            memory = self._memory
            if old.parent in memory.listings:
                memory.listings[old.parent][old.name] = stored
            else:
                batch = WriteBatch(raw_mode=True)
                batch.delete(schema.tree_inode_key(self.space, old.inode))
                batch.put(schema.tree_inode_key(self.space, stored.inode),
                          schema.encode_inode_record(stored))
                batch.put(schema.tree_entry_key(self.space, old.parent, old.name),
                          schema.encode_dir_entry(stored))
                # With the entry: a crash must not hand out its inode again.
                batch.put(schema.tree_meta_key(self.space, b"next"),
                          schema.encode_counter(self.next_inode))
                if not self._try_write(batch):
                    memory.changed[(old.parent, old.name)] = stored
            memory.locations.pop(old.inode, None)
            memory.locations[stored.inode] = (old.parent, old.name)
            self._count(old, -1)
            self._count(stored, 1)
            return stored

    def remove(self, old: DirEntry) -> bool:
        """The object was deleted from the bucket: its entry goes. False if it had gone
        already."""
        with self._lock:
            if self.child(old.parent, old.name) != old:
                return False
            memory = self._memory
            memory.locations.pop(old.inode, None)
            if old.parent in memory.listings:
                memory.listings[old.parent].pop(old.name, None)
            else:
                batch = WriteBatch(raw_mode=True)
                batch.delete(schema.tree_inode_key(self.space, old.inode))
                batch.delete(schema.tree_entry_key(self.space, old.parent, old.name))
                if not self._try_write(batch):
                    memory.changed[(old.parent, old.name)] = _REMOVED
            self._count(old, -1)
            return True

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

    def store(self, parent: int, children: list[DirEntry], listed_at: float) -> Changes:
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

    def add_page(self, listing: Listing, children: list[DirEntry]) -> Changes:
        """Store one page of a listing (in the order the bucket sent it). An entry that
        keeps its name, its kind and (a file) its version keeps its inode; one whose
        file changed gets a new inode, and the old one is `gone`. Raises
        IndexUnwritable if the index refused it."""
        with self._lock:
            if listing.in_memory:
                return self._add_in_memory(listing, children)
            batch, counts, changes = WriteBatch(raw_mode=True), _Counts(), Changes()
            written: dict[str, DirEntry] = {}  # by this page, not in the index yet
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
                entry = self._entry(listing, child, previous)
                if previous is not None and entry.inode != previous.inode:
                    batch.delete(schema.tree_inode_key(self.space, previous.inode))
                    if previous.stamp != listing.stamp:
                        changes.gone.append(previous)
                if previous is None or entry != previous:  # anything but the stamp
                    batch.put(schema.tree_inode_key(self.space, entry.inode),
                              schema.encode_inode_record(entry))
                if previous is not None:
                    counts.add(previous, -1)
                counts.add(entry, 1)
                written[child.name] = entry
                batch.put(schema.tree_entry_key(self.space, listing.parent, child.name),
                          schema.encode_dir_entry(entry))
            self._write(batch, counts)
            return changes

    def _entry(self, listing: Listing, child: DirEntry, previous: DirEntry | None,
               ) -> DirEntry:
        """A listed entry as stored; lock held."""
        if previous is not None and previous.same_object(child):
            inode = previous.inode
        else:
            inode = self.next_inode
            self.next_inode += 1
        return dataclasses.replace(child, inode=inode, parent=listing.parent,
                                   stamp=listing.stamp)

    def _add_in_memory(self, listing: Listing, children: list[DirEntry]) -> Changes:
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
            listing.entries[child.name] = self._entry(listing, child, previous)
        return changes

    def finish(self, listing: Listing, listed_at: float) -> list[DirEntry]:
        """The last page was stored: drop what the listing did not see, and count the
        directory as listed; the entries that went. Raises IndexUnwritable if the index
        refused it."""
        with self._lock:
            if listing.in_memory:
                return self._finish_in_memory(listing, listed_at)
            batch, counts, gone = WriteBatch(raw_mode=True), _Counts(), []
            prefix = schema.tree_dir_prefix(self.space, listing.parent)
            for key, value in prefixed(self.index, prefix):
                name = key[len(prefix):].decode("utf-8", "surrogateescape")
                entry = schema.decode_dir_entry(value, listing.parent, name)
                if entry.stamp != listing.stamp:
                    batch.delete(key)
                    batch.delete(schema.tree_inode_key(self.space, entry.inode))
                    counts.add(entry, -1)
                    gone.append(entry)
                if len(batch) >= _BATCH:
                    self._write(batch, counts)
                    batch, counts = WriteBatch(raw_mode=True), _Counts()
            # Last: the directory counts as listed only once all of it is stored.
            batch.put(schema.tree_listed_key(self.space, listing.parent),
                      schema.encode_listed_at(listed_at))
            self._write(batch, counts)
            return gone

    def _finish_in_memory(self, listing: Listing, listed_at: float) -> list[DirEntry]:
        memory = self._memory
        parent = listing.parent
        before = memory.listings.get(parent)
        if before is None:
            before = {entry.name: entry for entry in self.children(parent)}
        for entry in before.values():
            self._count(entry, -1)
            memory.locations.pop(entry.inode, None)
        for name, entry in listing.entries.items():
            self._count(entry, 1)
            memory.locations[entry.inode] = (parent, name)
            memory.changed.pop((parent, name), None)
        memory.listings[parent] = listing.entries
        memory.listed_at[parent] = listed_at
        return [entry for name, entry in before.items()
                if (now := listing.entries.get(name)) is None or now.inode != entry.inode]

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
                batch.put(schema.tree_meta_key(self.space, name), schema.encode_counter(value))
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

    def _count(self, entry: DirEntry, sign: int) -> None:
        self.known_files += sign
        self.known_bytes += sign * entry.size

    def forget_listings(self) -> None:
        """Every directory must be listed again (mount --refresh); inodes are kept."""
        start = schema.tree_listed_key(self.space, 0)[:-8]
        try:
            if not self.writable:
                raise IndexUnwritable
            self.index.delete_range(start, schema.next_prefix(start))
        except Exception as exc:
            self._unwritable(exc)
            self._memory.forgot_listings = True
        self._memory.listed_at.clear()


def upgrade_inode_records(index: Rdict) -> int:
    """Format 4's inode records held only where the entry is (parent inode and name);
    rewrite each with the entry it names (format 5), and say how many. Run again after
    a crash midway, it leaves the records already rewritten: read as format 4, they
    name no entry of their inode."""
    batch, upgraded = WriteBatch(raw_mode=True), 0
    for key, value in prefixed(index, schema.TREE_INODE):
        raw = index.get(schema.format4_entry_key(key, value))
        if raw is None:
            continue
        try:
            entry = schema.decode_dir_entry(raw, *schema.decode_format4_location(value))
        except (ValueError, struct.error):
            continue
        if entry.inode != schema.inode_of_key(key):
            continue
        batch.put(key, schema.encode_inode_record(entry))
        upgraded += 1
        if len(batch) >= _BATCH:
            index.write(batch)
            batch = WriteBatch(raw_mode=True)
    index.write(batch)
    return upgraded
