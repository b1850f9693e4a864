"""The directory tree: object keys split on "/" become directories.

Owns inode numbers and the listing of each directory. A directory is listed lazily
(the first lookup or readdir inside it), all pages at once, and the result is kept
for `metadata_ttl` seconds (by default for the life of the cache). The entries live in
a RocksDB index (cache/listings.py), not in Python objects: a `DirEntry` is a view made for
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

import dataclasses
import logging
import math
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TypeVar

import trio
from rocksdict import Rdict

from bucketfs.backends.base import ListPage, NotFound
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.index_options import index_options
from bucketfs.cache.listings import ROOT_INODE, IndexUnwritable, TreeIndex
from bucketfs.cache.schema import DirEntry, tree_space
from bucketfs.runtime import scratch_root
from bucketfs.workers import in_worker

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")

NAME_MAX = 255
#: Old inodes remembered for the kernel (see Namespace._retired).
RETIRED = 65_536
#: Directory entries kept in memory (every lookup of a file reads its directory's).
DIRECTORIES = 65_536


def scratch_tree_dir() -> str:
    """A new private directory for a mount's temporary tree index, in the user's cache
    home on disk: not /tmp, which is often RAM outside every budget. Ones left by
    daemons that died (kill -9) are removed first."""
    root = scratch_root()
    for path in root.glob("tree-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"tree-{os.getpid()}-", dir=root)


def keep_bounded(kept: dict[K, V], key: K, value: V, limit: int) -> None:
    """`kept[key] = value`, then the oldest entry dropped while more than `limit`
    remain (first in, first out: a dict keeps insertion order)."""
    kept[key] = value
    if len(kept) > limit:
        del kept[next(iter(kept))]


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
        on_gone: Callable[[int, str], None] | None = None,
    ) -> None:
        """`index`: the cache's RocksDB (listings outlive the mount), or None for a
        temporary one on disk (`scratch_tree_dir`). `space` names the origin and prefix,
        so mounts sharing an index stay apart.
        `clock`: wall-clock seconds (listing times are compared across mounts).
        `on_gone(parent inode, name)`: told when a name stops naming its inode (the
        object was deleted, or changed and got a new inode), so the kernel can forget
        what it cached of the name."""
        self.store = store
        self.metadata_ttl = metadata_ttl
        self.clock = clock
        self.mount_time_ns = time.time_ns()
        self._temporary: str | None = None
        if index is None:
            self._temporary = scratch_tree_dir()
            index = Rdict(self._temporary, index_options())
        self.index = index
        self.tree = TreeIndex(index, tree_space(space, root_prefix))
        self._warned: set[str] = set()
        self._listing: dict[int, trio.Event] = {}
        self.on_gone = on_gone
        #: Inodes that no longer name an entry (an older version, a deleted object) but
        #: that the kernel may still hold (open handles, cached dentries): kept until it
        #: forgets them, so a handle's fstat still works and its reads stay on its
        #: version. At most RETIRED of them (a re-listing can retire a whole directory
        #: the kernel never looked at); past that an old inode's getattr is ENOENT.
        self._retired: OrderedDict[int, DirEntry] = OrderedDict()
        #: Directories as `get` last read them (first in, first out): a directory's
        #: entry changes only by leaving the tree, which `_gone` tells.
        self._directories: dict[int, DirEntry] = {}
        #: When each directory was last listed, as the tree says (first in, first out):
        #: every lookup asks, and only `_list` and `forget_listings` change it.
        self._listed_at: dict[int, float] = {}
        self.root = DirEntry(inode=ROOT_INODE, parent=ROOT_INODE, name="", is_dir=True,
                         key=root_prefix, mtime_ns=self.mount_time_ns)

    def close(self) -> None:
        if self._temporary is not None:
            self.index.close()
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None

    # --- entries ------------------------------------------------------------------------

    def _view(self, entry: DirEntry) -> DirEntry:
        """An entry as the kernel sees it: directories carry the mount's time."""
        if entry.is_dir and entry.mtime_ns != self.mount_time_ns:
            return dataclasses.replace(entry, mtime_ns=self.mount_time_ns)
        return entry

    def get(self, inode: int) -> DirEntry:
        """Raises KeyError for an inode this tree does not hold."""
        if inode == ROOT_INODE:
            return self.root
        directory = self._directories.get(inode)
        if directory is not None:
            return directory
        entry = self.tree.entry_of(inode)
        if entry is None:
            retired = self._retired.get(inode)
            if retired is None:
                raise KeyError(inode)
            return retired
        entry = self._view(entry)
        if entry.is_dir:
            keep_bounded(self._directories, inode, entry, DIRECTORIES)
        return entry

    def forget(self, inode: int) -> None:
        """The kernel holds the inode no more."""
        self._retired.pop(inode, None)

    def _gone(self, entries: list[DirEntry], *, tell: bool = False) -> None:
        """Names that stopped naming their inodes: retire the inodes; with `tell`, tell
        `on_gone` (after a re-listing the kernel's TTL, never longer than the
        listing's, lets the kernel find out by itself)."""
        for entry in entries:
            self._directories.pop(entry.inode, None)
            self._retired[entry.inode] = self._view(entry)
            if len(self._retired) > RETIRED:
                self._retired.popitem(last=False)
            if tell and self.on_gone is not None:
                self.on_gone(entry.parent, entry.name)

    @property
    def known_bytes(self) -> int:
        return self.tree.known_bytes

    @property
    def known_files(self) -> int:
        return self.tree.known_files

    async def lookup(self, parent: int, name: str) -> DirEntry | None:
        directory = self.get(parent)
        if not directory.is_dir:
            return None
        await self._listed(directory)
        entry = self.tree.child(parent, name)
        return None if entry is None else self._view(entry)

    async def entries(self, inode: int, after: str | None = None) -> Iterator[DirEntry]:
        """A directory's entries in name order, from the first name after `after`."""
        await self._listed(self.get(inode))
        return (self._view(entry) for entry in self.tree.children(inode, after))

    async def children(self, inode: int) -> list[DirEntry]:
        """All entries of a directory, sorted by name (small directories and tests)."""
        return list(await self.entries(inode))

    async def refresh(self, node: DirEntry) -> None:
        """A read found that `node`'s version is gone from the bucket: look the object
        up again. A new version gets a new inode (the kernel's pages of the old inode
        hold the old version, which handles opened on it go on reading or fail); a
        deleted object leaves the tree. New opens then see the bucket as it is."""
        current = self.tree.child(node.parent, node.name)
        if current is None or current.inode != node.inode:
            return  # another read refreshed it already
        try:
            info = await self.store.head(node.key)
        except NotFound:
            if self.tree.remove(current):
                self._gone([current], tell=True)
            return
        if info.version == current.version:
            return
        self.tree.replace(current, DirEntry(node.name, False, node.key, info.size,
                                            info.mtime_ns, info.version))
        self._gone([current], tell=True)

    def forget_listings(self) -> None:
        self.tree.forget_listings()
        self._listed_at.clear()

    def any_file_key(self) -> str | None:
        return self.tree.any_file_key()

    # --- listing ------------------------------------------------------------------------

    def _fresh(self, directory: DirEntry) -> bool:
        listed_at = self._listed_at.get(directory.inode)
        if listed_at is None:
            listed_at = self.tree.listed_at(directory.inode)
            if listed_at is None:
                return False
            keep_bounded(self._listed_at, directory.inode, listed_at, DIRECTORIES)
        return self.clock() - listed_at < self.metadata_ttl

    async def _listed(self, directory: DirEntry) -> None:
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
                await self._list(directory)
            finally:
                flight.set()
                del self._listing[directory.inode]
            return

    async def _list(self, directory: DirEntry) -> None:
        """List a directory into the tree page by page: one page in memory at a time
        however large the directory, each stored from a worker thread."""
        listed_at = self.clock()
        for in_memory in (False, True):
            listing = self.tree.begin(directory.inode)
            try:
                async for page in self.store.list_pages(directory.key):
                    changes = await in_worker(
                        self.tree.add_page, listing, self._children(directory, page))
                    for key in changes.hidden:
                        self._warn_once(key, f"object {key!r} is hidden by the directory "
                                             f"{key + '/'!r} of the same name")
                    self._gone(changes.gone)
                self._gone(await in_worker(self.tree.finish, listing, listed_at))
                keep_bounded(self._listed_at, directory.inode, listed_at, DIRECTORIES)
                return
            except IndexUnwritable:
                if in_memory:
                    raise
                # The index stopped taking writes: list it again, into memory.

    def _children(self, directory: DirEntry, page: ListPage) -> list[DirEntry]:
        """The entries one page of a listing names (a prefix and an object of one name
        may come on different pages: the tree settles that)."""
        children: list[DirEntry] = []
        prefix_len = len(directory.key)
        for prefix in page.prefixes:
            name = prefix[prefix_len:-1]
            if self._acceptable(prefix, name):
                children.append(DirEntry(name, True, prefix))
        for info in page.objects:
            if info.key == directory.key:
                continue  # the directory's own "dir/" marker object
            name = info.key[prefix_len:]
            if name.endswith("/"):
                name = name[:-1]  # an empty marker reported as an object
                if self._acceptable(info.key, name):
                    children.append(DirEntry(name, True, info.key))
                continue
            if self._acceptable(info.key, name):
                children.append(DirEntry(name, False, info.key, info.size, info.mtime_ns,
                                      info.version))
        return children

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
