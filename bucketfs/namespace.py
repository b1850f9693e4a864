"""The directory tree: object keys split on "/" become directories.

Owns inode numbers and the listing of each directory. A directory is listed lazily
(the first lookup or readdir inside it), all pages at once, and the result is kept
for `metadata_ttl` seconds (by default for the life of the mount). Inodes are never
reused while mounted, so a kernel that remembers one always finds the same entry.

Rules for keys that do not map cleanly onto a POSIX tree (see docs/ARCHITECTURE.md):
- an object `a` and a prefix `a/` both exist: the directory wins, the object is hidden;
- `dir/` marker objects and common prefixes both make directories;
- names that are empty (`a//b`), `.`, `..`, hold NUL, or exceed 255 bytes are skipped,
  each with one warning.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyfuse3
import trio

from bucketfs.backends.base import ObjectInfo
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.listings import ListingCache

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
    #: Directories only: name -> inode, filled by listing; None until listed.
    children: dict[str, int] | None = None
    sorted_names: list[str] | None = None
    listed_at: float = -math.inf
    listing: trio.Event | None = None


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
        metadata_ttl: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
        saved: ListingCache | None = None,
    ) -> None:
        self.store = store
        self.metadata_ttl = metadata_ttl
        #: Listings kept from earlier mounts (with --cache-dir), trusted within the TTL.
        self.saved = saved
        self.clock = clock
        self.mount_time_ns = time.time_ns()
        self.nodes: dict[int, Node] = {}
        self._next_inode = pyfuse3.ROOT_INODE + 1
        self._warned: set[str] = set()
        self.root = Node(
            inode=pyfuse3.ROOT_INODE, parent=pyfuse3.ROOT_INODE, name="", is_dir=True,
            key=root_prefix, mtime_ns=self.mount_time_ns,
        )
        self.nodes[self.root.inode] = self.root

    def get(self, inode: int) -> Node:
        """Raises KeyError for an inode this mount never handed out."""
        return self.nodes[inode]

    @property
    def known_bytes(self) -> int:
        return sum(node.size for node in self.nodes.values())

    async def lookup(self, parent: int, name: str) -> Node | None:
        directory = self.nodes[parent]
        if not directory.is_dir:
            return None
        children = await self._listed(directory)
        inode = children.get(name)
        return None if inode is None else self.nodes[inode]

    async def children(self, inode: int) -> list[Node]:
        """Entries of a directory, sorted by name."""
        names, children = await self.listing(inode)
        return [self.nodes[children[name]] for name in names]

    async def listing(self, inode: int) -> tuple[list[str], dict[str, int]]:
        """A directory's sorted names (readdir offsets index them) and name -> inode, as
        they are: readdir of a huge directory must not copy them once per request."""
        directory = self.nodes[inode]
        children = await self._listed(directory)
        assert directory.sorted_names is not None
        return directory.sorted_names, children

    def update_file(self, node: Node, info: ObjectInfo) -> None:
        """The object changed in the bucket: new opens see the new version."""
        node.size, node.mtime_ns, node.version = info.size, info.mtime_ns, info.version

    def _fresh(self, directory: Node) -> bool:
        return self.clock() - directory.listed_at < self.metadata_ttl

    async def _listed(self, directory: Node) -> dict[str, int]:
        # Single-flight: concurrent lookups in an unlisted directory share one listing.
        while directory.children is None or not self._fresh(directory):
            if directory.listing is not None:
                await directory.listing.wait()
                if directory.children is not None and self._fresh(directory):
                    break
                continue
            directory.listing = trio.Event()
            try:
                await self._list(directory)
            finally:
                directory.listing.set()
                directory.listing = None
        return directory.children

    async def _list(self, directory: Node) -> None:
        listing, age = None, 0.0
        if self.saved is not None and directory.children is None:
            found = self.saved.get(directory.key)
            if found is not None and found[1] < self.metadata_ttl:
                listing, age = found
        if listing is None:
            listing = await self.store.list_dir(directory.key)
            if self.saved is not None:
                self.saved.put(directory.key, listing)
        old = directory.children or {}
        children: dict[str, int] = {}
        prefix_len = len(directory.key)
        for prefix in listing.prefixes:
            name = prefix[prefix_len:-1]
            if self._acceptable(prefix, name):
                children[name] = self._node(old, directory, name, True, prefix).inode
        for info in listing.objects:
            if info.key == directory.key:
                continue  # the directory's own "dir/" marker object
            name = info.key[prefix_len:]
            if name.endswith("/"):
                name = name[:-1]  # an empty marker reported as an object
                if self._acceptable(info.key, name) and name not in children:
                    children[name] = self._node(old, directory, name, True, info.key).inode
                continue
            if not self._acceptable(info.key, name):
                continue
            if name in children:
                self._warn_once(info.key, f"object {info.key!r} is hidden by the directory "
                                          f"{info.key + '/'!r} of the same name")
                continue
            node = self._node(old, directory, name, False, info.key)
            self.update_file(node, info)
            children[name] = node.inode
        directory.children = children
        directory.sorted_names = sorted(children)
        directory.listed_at = self.clock() - age

    def _node(self, old: dict[str, int], parent: Node, name: str, is_dir: bool, key: str) -> Node:
        """Reuse the inode of an entry that survives a re-listing; else make a new one."""
        inode = old.get(name)
        if inode is not None and self.nodes[inode].is_dir == is_dir:
            return self.nodes[inode]
        node = Node(inode=self._next_inode, parent=parent.inode, name=name, is_dir=is_dir,
                    key=key, mtime_ns=self.mount_time_ns)
        self._next_inode += 1
        self.nodes[node.inode] = node
        return node

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
