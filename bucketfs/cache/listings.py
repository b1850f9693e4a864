"""The directory tree as records in a RocksDB index, so neither the daemon's memory nor
its startup time grows with the number of objects in the bucket, and a remount reuses
the listings (and the inode numbers) of the last one without listing the bucket.

Keys, under a `space` naming the bucket and the mounted prefix:

    N space \\0 parent-inode name   -> the entry's record (Record.pack)
    I space \\0 inode               -> parent-inode name (to find the entry from its inode)
    S space \\0 directory-inode     -> when the directory was listed (wall-clock seconds)
    M space \\0 next|bytes|files    -> the next free inode and the totals for statfs

Entries sit under their parent sorted by name (UTF-8 byte order), so readdir is a
seek and a scan. A directory counts as listed once its `S` record exists; that record
is written in the last batch of a listing, so a listing cut short by a crash is made
again. Blocking: point reads are cheap enough for the trio thread; `store` of a whole
listing runs in a worker thread, serialised by a lock.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from rocksdict import Rdict, WriteBatch

from bucketfs.cache.scans import prefixed

ROOT_INODE = 1
ENTRY = b"N"
INODE = b"I"
LISTED = b"S"
META = b"M"
_U64 = struct.Struct(">Q")
_FIXED = struct.Struct("<QBQq")  # inode, is_dir, size, mtime_ns
_BATCH = 20_000


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
    kernel_version: str = ""

    def pack(self) -> bytes:
        return (_FIXED.pack(self.inode, self.is_dir, self.size, self.mtime_ns)
                + _text(self.key) + _text(self.version) + _text(self.kernel_version))

    @classmethod
    def unpack(cls, raw: bytes) -> Record:
        inode, is_dir, size, mtime_ns = _FIXED.unpack_from(raw)
        at, texts = _FIXED.size, []
        for _ in range(3):
            (length,) = struct.unpack_from("<I", raw, at)
            texts.append(raw[at + 4:at + 4 + length].decode("utf-8", "surrogateescape"))
            at += 4 + length
        return cls(inode, bool(is_dir), texts[0], size, mtime_ns, texts[1], texts[2])


@dataclass(slots=True)
class Child:
    """One entry of a new listing, before it has an inode."""

    name: str
    is_dir: bool
    key: str
    size: int = 0
    mtime_ns: int = 0
    version: str = ""


class TreeIndex:
    def __init__(self, index: Rdict, space: str) -> None:
        self.index = index
        self.space = space.encode("utf-8", "surrogateescape") + b"\0"
        self._lock = threading.Lock()
        self.next_inode = self._meta(b"next") or ROOT_INODE + 1
        self.known_bytes = self._meta(b"bytes")
        self.known_files = self._meta(b"files")

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
        raw = self.index.get(self._entry_key(parent, name))
        return None if raw is None else Record.unpack(raw)

    def locate(self, inode: int) -> tuple[int, str] | None:
        """(parent inode, name) of an inode, or None if no listing holds it."""
        raw = self.index.get(self._inode_key(inode))
        if raw is None:
            return None
        return _U64.unpack_from(raw)[0], raw[8:].decode("utf-8", "surrogateescape")

    def listed_at(self, inode: int) -> float | None:
        raw = self.index.get(self._listed_key(inode))
        return None if raw is None else struct.unpack("<d", raw)[0]

    def children(self, parent: int, after: str | None = None) -> Iterator[tuple[str, Record]]:
        """(name, record) of a directory's entries in name order, from the first name
        after `after` (readdir resumes there)."""
        prefix = self._dir_prefix(parent)
        start = None if after is None else self._entry_key(parent, after) + b"\0"
        for key, value in prefixed(self.index, prefix, start):
            yield key[len(prefix):].decode("utf-8", "surrogateescape"), Record.unpack(value)

    def any_file_key(self) -> str | None:
        """The key of one object some listing names (to probe access with a HEAD)."""
        for _, value in prefixed(self.index, ENTRY + self.space):
            record = Record.unpack(value)
            if not record.is_dir:
                return record.key
        return None

    # --- writes -------------------------------------------------------------------------

    def update(self, parent: int, name: str, record: Record, old_size: int) -> None:
        """Rewrite one entry (a new version seen by a HEAD, the kernel's cached version)."""
        self.index[self._entry_key(parent, name)] = record.pack()
        self.known_bytes += record.size - old_size

    def store(self, parent: int, children: list[Child], listed_at: float) -> None:
        """Replace a directory's entries with a new listing. An entry that keeps its
        name and kind keeps its inode; entries that are gone are removed (what was below
        a removed directory stays as unreachable records)."""
        with self._lock:
            old = {name: record for name, record in self.children(parent)}
            batch = WriteBatch(raw_mode=True)
            for child in children:
                previous = old.pop(child.name, None)
                if previous is not None and previous.is_dir == child.is_dir:
                    inode, kernel_version = previous.inode, previous.kernel_version
                    self._count(previous, -1)
                else:
                    if previous is not None:
                        self._drop(batch, parent, child.name, previous)
                    inode, kernel_version = self.next_inode, ""
                    self.next_inode += 1
                    batch.put(self._inode_key(inode), _U64.pack(parent)
                              + child.name.encode("utf-8", "surrogateescape"))
                record = Record(inode, child.is_dir, child.key, child.size, child.mtime_ns,
                                child.version, kernel_version)
                self._count(record, 1)
                batch.put(self._entry_key(parent, child.name), record.pack())
                if len(batch) >= _BATCH:
                    self.index.write(batch)
                    batch = WriteBatch(raw_mode=True)
            for name, record in old.items():
                self._drop(batch, parent, name, record)
            for name, value in ((b"next", self.next_inode), (b"bytes", self.known_bytes),
                                (b"files", self.known_files)):
                batch.put(META + self.space + name, _U64.pack(max(value, 0)))
            # Last: the directory counts as listed only once all of it is stored.
            batch.put(self._listed_key(parent), struct.pack("<d", listed_at))
            self.index.write(batch)

    def _drop(self, batch: WriteBatch, parent: int, name: str, record: Record) -> None:
        batch.delete(self._entry_key(parent, name))
        batch.delete(self._inode_key(record.inode))
        self._count(record, -1)

    def _count(self, record: Record, sign: int) -> None:
        self.known_files += sign
        self.known_bytes += sign * record.size

    def forget_listings(self) -> None:
        """Every directory must be listed again (mount --refresh); inodes are kept."""
        self.index.delete_range(LISTED + self.space, LISTED + self.space[:-1] + b"\1")
