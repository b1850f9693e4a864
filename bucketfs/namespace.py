"""The directory tree: object keys split on "/" become directories.

Owns inode numbers and the listing of each directory. A directory is listed lazily
(the first lookup or readdir inside it), all pages at once, and the result is kept
for `metadata_ttl` seconds (by default for the life of the cache). The entries live in
a RocksDB index (cache/listings.py), not in Python objects: a `Node` is a view made for
one request. With a cache directory that index is the cache's, so a remount reuses the
listings and the inode numbers; without one it is a temporary index deleted at
unmount. Inodes are never reused, so a kernel that remembers one always finds the same
entry (or none, once a re-listing found it gone).

Rules for keys that do not map cleanly onto a POSIX tree (see docs/ARCHITECTURE.md):
- an object `a` and a prefix `a/` both exist: the directory wins, the object is hidden;
- `dir/` marker objects and common prefixes both make directories;
- names that are empty (`a//b`), `.`, `..`, hold NUL, or exceed 255 bytes are skipped,
  each with one warning.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import trio
from rocksdict import Options, Rdict

from bucketfs.backends.base import ObjectInfo
from bucketfs.backends.store import DirListing, ObjectStore
from bucketfs.cache.listings import ROOT_INODE, Child, Record, TreeIndex

log = logging.getLogger(__name__)

NAME_MAX = 255


@dataclass(slots=True)
class Node:
    inode: int
    parent: int
    name: str
    is_dir: bool
    #: The object key for a file; the prefix (ending in "/", or "" at the bucket root) for
    #: a directory.
    key: str
    size: int = 0
    mtime_ns: int = 0
    version: str = ""
    #: The version the kernel page cache may hold bytes of ("" before the first open).
    kernel_version: str = ""


def invalid_name_reason(name: str) -> str | None:
    if name in ("", ".", ".."):
        return f"the path segment {name!r} cannot be a file name"
    if "\0" in name:
        return "the name contains a NUL byte"
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        return f"the name is longer than {NAME_MAX} bytes"
    return None


class Namespace:
    def __init__(
        self,
        store: ObjectStore,
        root_prefix: str,
        *,
        index: Rdict | None = None,
        space: str = "",
        metadata_ttl: float = math.inf,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`index`: the cache's RocksDB (listings outlive the mount), or None for a
        temporary one. `space` names the bucket, so buckets sharing an index stay apart.
        `clock`: wall-clock seconds (listing times are compared across mounts)."""
        self.store = store
        self.metadata_ttl = metadata_ttl
        self.clock = clock
        self.mount_time_ns = time.time_ns()
        self._temporary: str | None = None
        if index is None:
            self._temporary = tempfile.mkdtemp(prefix="bucketfs-tree-")
            index = Rdict(self._temporary, Options(raw_mode=True))
        self.index = index
        self.tree = TreeIndex(index, f"{space}\0{root_prefix}")
        self._warned: set[str] = set()
        self._listing: dict[int, trio.Event] = {}
        self.root = Node(inode=ROOT_INODE, parent=ROOT_INODE, name="", is_dir=True,
                         key=root_prefix, mtime_ns=self.mount_time_ns)

    def close(self) -> None:
        if self._temporary is not None:
            self.index.close()
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None

    # --- entries ------------------------------------------------------------------------

    def _node(self, parent: int, name: str, record: Record) -> Node:
        return Node(record.inode, parent, name, record.is_dir, record.key, record.size,
                    record.mtime_ns if not record.is_dir else self.mount_time_ns,
                    record.version, record.kernel_version)

    def get(self, inode: int) -> Node:
        """Raises KeyError for an inode this tree does not hold."""
        if inode == ROOT_INODE:
            return self.root
        where = self.tree.locate(inode)
        record = self.tree.child(*where) if where is not None else None
        if record is None or record.inode != inode:
            raise KeyError(inode)
        return self._node(where[0], where[1], record)

    @property
    def known_bytes(self) -> int:
        return self.tree.known_bytes

    @property
    def known_files(self) -> int:
        return self.tree.known_files

    async def lookup(self, parent: int, name: str) -> Node | None:
        directory = self.get(parent)
        if not directory.is_dir:
            return None
        await self._listed(directory)
        record = self.tree.child(parent, name)
        return None if record is None else self._node(parent, name, record)

    async def entries(self, inode: int, after: str | None = None) -> Iterator[Node]:
        """A directory's entries in name order, from the first name after `after`."""
        await self._listed(self.get(inode))
        return (self._node(inode, name, record)
                for name, record in self.tree.children(inode, after))

    async def children(self, inode: int) -> list[Node]:
        """All entries of a directory, sorted by name (small directories and tests)."""
        return list(await self.entries(inode))

    def update_file(self, node: Node, info: ObjectInfo) -> None:
        """The object changed in the bucket: new opens see the new version."""
        old_size = node.size
        node.size, node.mtime_ns, node.version = info.size, info.mtime_ns, info.version
        self._save(node, old_size)

    def mark_gone(self, node: Node) -> None:
        """The object was deleted from the bucket while open."""
        old_size, node.size, node.version = node.size, 0, "gone"
        self._save(node, old_size)

    def set_kernel_version(self, node: Node, version: str) -> None:
        if node.kernel_version != version:
            node.kernel_version = version
            self._save(node, node.size)

    def _save(self, node: Node, old_size: int) -> None:
        if node.inode == ROOT_INODE:
            return
        self.tree.update(node.parent, node.name, Record(
            node.inode, node.is_dir, node.key, node.size, node.mtime_ns, node.version,
            node.kernel_version), old_size)

    def forget_listings(self) -> None:
        self.tree.forget_listings()

    def any_file_key(self) -> str | None:
        return self.tree.any_file_key()

    # --- listing ------------------------------------------------------------------------

    def _fresh(self, directory: Node) -> bool:
        listed_at = self.tree.listed_at(directory.inode)
        return listed_at is not None and self.clock() - listed_at < self.metadata_ttl

    async def _listed(self, directory: Node) -> None:
        # Single-flight: concurrent lookups in an unlisted directory share one listing. A
        # listing this call made or waited for is fresh enough for it, whatever the TTL
        # (with metadata_ttl 0 it would otherwise list forever).
        while not self._fresh(directory):
            flight = self._listing.get(directory.inode)
            if flight is not None:
                await flight.wait()
                if self.tree.listed_at(directory.inode) is not None:
                    return
                continue  # it failed before anything was listed: try ourselves
            flight = self._listing[directory.inode] = trio.Event()
            try:
                listing = await self.store.list_dir(directory.key)
                # Both steps are proportional to the directory: not in the trio thread.
                await trio.to_thread.run_sync(self._store, directory, listing, self.clock())
            finally:
                flight.set()
                del self._listing[directory.inode]
            return

    def _store(self, directory: Node, listing: DirListing, listed_at: float) -> None:
        self.tree.store(directory.inode, self._children(directory, listing), listed_at)

    def _children(self, directory: Node, listing: DirListing) -> list[Child]:
        children: dict[str, Child] = {}
        prefix_len = len(directory.key)
        for prefix in listing.prefixes:
            name = prefix[prefix_len:-1]
            if self._acceptable(prefix, name):
                children[name] = Child(name, True, prefix)
        for info in listing.objects:
            if info.key == directory.key:
                continue  # the directory's own "dir/" marker object
            name = info.key[prefix_len:]
            if name.endswith("/"):
                name = name[:-1]  # an empty marker reported as an object
                if self._acceptable(info.key, name) and name not in children:
                    children[name] = Child(name, True, info.key)
                continue
            if not self._acceptable(info.key, name):
                continue
            if name in children:
                self._warn_once(info.key, f"object {info.key!r} is hidden by the directory "
                                          f"{info.key + '/'!r} of the same name")
                continue
            children[name] = Child(name, False, info.key, info.size, info.mtime_ns,
                                   info.version)
        return list(children.values())

    def _acceptable(self, key: str, name: str) -> bool:
        reason = invalid_name_reason(name)
        if reason is None:
            return True
        self._warn_once(key, f"skipping key {key!r}: {reason}")
        return False

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)
