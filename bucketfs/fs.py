"""The FUSE operations: a thin edge that translates between the kernel and the
namespace and reader. Only FUSEError leaves a handler; everything that would modify
the tree answers EROFS.
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import pyfuse3

from bucketfs.backends.base import BackendError, VersionChanged
from bucketfs.cache.schema import DirEntry
from bucketfs.logs import Throttle, held_back
from bucketfs.namespace import Namespace, keep_bounded
from bucketfs.reader import OpenFile, Reader

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT

#: Files whose read state is kept when the kernel opens files itself (`Operations`);
#: fewer when the RAM tier cannot hold a block, since each state then keeps its last
#: block (`OpenFile.last`) outside every budget, as an open handle does.
READ_STATES = 4096
_READ_STATES_WITH_BLOCKS = 64
#: Files the kernel looked up last, kept by inode until their first read: the READ that
#: follows a LOOKUP (the kernel opening the file itself) takes its entry from here, not
#: from the index (two RocksDB reads and a decode on the trio thread, per file). An
#: inode stands for one version, so a kept entry never goes stale.
_LOOKED_UP = 1024
#: pyfuse3 built with bucketfs's patch (packaging/pyfuse3/build.py): `read` is told the
#: inode when no OPEN preceded it, and `max_background` reaches the kernel.
PATCHED_PYFUSE3 = getattr(pyfuse3, "BUCKETFS_PATCH", 0) >= 1


#: Requests that failed with EIO since the daemon started, by operation (the metrics
#: read it): each is counted, and logged at most once a minute per operation and kind
#: of error (every one at DEBUG), so a client that rereads a file the bucket refuses
#: cannot fill the log's disk.
request_failures: collections.Counter[str] = collections.Counter()
_QUIET_S = 60.0
_throttle = Throttle(_QUIET_S)


def fuse_errors(handler: F) -> F:
    """Translate whatever a handler raises into a FUSEError for the kernel."""
    operation = handler.__name__

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except KeyError:  # an inode this mount never handed out
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        except Exception as exc:
            _failed(operation, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return cast(F, wrapper)


def _failed(operation: str, exc: Exception) -> None:
    request_failures[operation] += 1
    held = _throttle.admit(f"{operation}: {type(exc).__name__}")
    if held is None:
        log.debug("%s failed", operation, exc_info=exc)
    elif isinstance(exc, BackendError):  # the bucket's answer, already one line
        log.error("%s: %s%s", operation, exc, held_back(held))
    else:  # a bug: its traceback
        log.error("%s failed%s", operation, held_back(held), exc_info=exc)


def _read_only(name: str) -> Callable[..., Awaitable[None]]:
    async def handler(self: Operations, *args: Any) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    handler.__name__ = name
    return handler


@dataclass(slots=True)
class _DirCursor:
    """An open directory: where the last readdir stopped."""

    inode: int
    offset: int = 0
    last_name: str = ""


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self, namespace: Namespace, reader: Reader, *, uid: int, gid: int, kernel_ttl: float,
        kernel_opens: bool = False, max_background: int = 0,
    ) -> None:
        """`kernel_opens`: answer OPEN with ENOSYS, so that the kernel opens and releases
        files itself for the life of the mount (FUSE no_open) and keeps their page
        cache. Needs `PATCHED_PYFUSE3`: each READ then names the inode in place of a
        handle, and a read at offset 0 stands for an open (the hints' view of a reader
        starting a file). `max_background`: read-ahead requests the kernel keeps in
        flight (0: its default)."""
        super().__init__()
        if kernel_opens and not PATCHED_PYFUSE3:
            raise ValueError("kernel_opens needs pyfuse3 with bucketfs's patch")
        self.kernel_opens = kernel_opens
        if max_background:
            self.max_background = max_background  # read by the patched pyfuse3's init
        #: With kernel_opens: per inode, the read state of its latest reader (an LRU).
        self.read_states: collections.OrderedDict[int, tuple[DirEntry, OpenFile]] = \
            collections.OrderedDict()
        self.read_states_limit = READ_STATES if reader.cache.keeps_in_ram(
            reader.block_size) else _READ_STATES_WITH_BLOCKS
        self.namespace = namespace
        self.reader = reader
        self.uid = uid
        self.gid = gid
        self.kernel_ttl = kernel_ttl
        self.handles: dict[int, tuple[DirEntry, OpenFile]] = {}
        #: Oldest first; at most `_LOOKED_UP` (see there).
        self.looked_up: dict[int, DirEntry] = {}
        self.dir_handles: dict[int, _DirCursor] = {}
        self._next_fh = 1

    def _attributes(self, node: DirEntry) -> pyfuse3.EntryAttributes:
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino = node.inode
        attrs.generation = 0
        attrs.entry_timeout = self.kernel_ttl
        attrs.attr_timeout = self.kernel_ttl
        if node.is_dir:
            attrs.st_mode = stat.S_IFDIR | 0o555
            # 1 tells find(1) and friends not to infer subdirectory counts from nlink.
            attrs.st_nlink = 1
        else:
            attrs.st_mode = stat.S_IFREG | 0o444
            attrs.st_nlink = 1
        attrs.st_size = node.size
        attrs.st_blksize = 128 * 1024
        attrs.st_blocks = (node.size + 511) // 512
        attrs.st_uid = self.uid
        attrs.st_gid = self.gid
        attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = node.mtime_ns
        return attrs

    @fuse_errors
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        node = await self.namespace.lookup(parent_inode, os.fsdecode(name))
        if node is None:
            # Inode 0 with a timeout makes the kernel remember that the name is missing.
            attrs = pyfuse3.EntryAttributes()
            attrs.st_ino = 0
            attrs.entry_timeout = self.kernel_ttl
            return attrs
        if not node.is_dir:
            keep_bounded(self.looked_up, node.inode, node, _LOOKED_UP)
        return self._attributes(node)

    @fuse_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attributes(self.namespace.get(inode))

    @fuse_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self.namespace.get(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        fh = self._next_fh
        self._next_fh += 1
        self.dir_handles[fh] = _DirCursor(inode)
        return fh

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # An offset counts the entries before it in name order. A readdir that goes on
        # where the last one stopped resumes after the last name sent (a seek in the
        # index); any other offset (a seekdir) counts entries from the start.
        cursor = self.dir_handles[fh]
        resume = start_id > 0 and start_id == cursor.offset
        skip = 0 if resume else start_id
        offset = start_id
        for node in await self.namespace.entries(cursor.inode,
                                                 cursor.last_name if resume else None):
            if skip:
                skip -= 1
                continue
            if not pyfuse3.readdir_reply(
                token, os.fsencode(node.name), self._attributes(node), offset + 1
            ):
                break
            offset += 1
            cursor.offset, cursor.last_name = offset, node.name

    async def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if self.kernel_opens:
            # Only the first OPEN of the mount comes here. The mount is read-only
            # (`ro`), so the kernel refuses opens for writing before asking.
            raise pyfuse3.FUSEError(errno.ENOSYS)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self.file_entry(inode)
        fh = self._next_fh
        self._next_fh += 1
        self.opened(fh, node)
        # An inode stands for one version (a changed object gets a new inode), and the
        # bytes of a version never change: the kernel page cache may keep them.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    def file_entry(self, inode: int) -> DirEntry:
        """The file `inode` names, as its lookup found it, else from the index
        (KeyError: never handed out); EISDIR for a directory."""
        node = self.looked_up.pop(inode, None) or self.namespace.get(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return node

    def opened(self, fh: int, node: DirEntry) -> None:
        """Keep what reads of the new handle `fh` need."""
        self.handles[fh] = (node, self.reader.open(node.key, node.version, node.size))

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        node, handle = self._read_state(fh, off) if self.kernel_opens else self.handles[fh]
        try:
            return await self.reader.read(handle, off, size)
        except VersionChanged:
            # This handle stays on its version, and fails; later opens see the bucket.
            log.warning("object %r changed in the bucket while open; reads of the old "
                        "version fail, new opens get the new version", node.key)
            try:
                await self.namespace.refresh(node)
            except BackendError as exc:
                log.warning("cannot look %r up again: %s", node.key, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None

    def _read_state(self, inode: int, offset: int) -> tuple[DirEntry, OpenFile]:
        """The read state of a file the kernel opened itself: made at the first read of
        the file, and again at a read of its start (a reader that starts the file)."""
        state = self.read_states.get(inode)
        if state is not None and offset != 0:
            self.read_states.move_to_end(inode)
            return state
        node = state[0] if state is not None else self.file_entry(inode)
        state = self.read_states[inode] = (
            node, self.reader.open(node.key, node.version, node.size))
        self.read_states.move_to_end(inode)
        if len(self.read_states) > self.read_states_limit:
            self.read_states.popitem(last=False)
        return state

    async def release(self, fh: int) -> None:
        # Nothing is held per handle: blocks in flight finish into the cache.
        self.handles.pop(fh, None)

    @fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = (self.namespace.known_bytes + 4095) // 4096
        data.f_bfree = data.f_bavail = 0
        data.f_files = self.namespace.known_files + 1
        data.f_ffree = data.f_favail = 0
        data.f_namemax = 255
        return data

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return []

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        # Entries live in the index; only inodes of replaced versions are held here.
        for inode, _ in inode_list:
            self.namespace.forget(inode)
            self.read_states.pop(inode, None)
            self.looked_up.pop(inode, None)

    setattr = _read_only("setattr")
    mknod = _read_only("mknod")
    mkdir = _read_only("mkdir")
    unlink = _read_only("unlink")
    rmdir = _read_only("rmdir")
    symlink = _read_only("symlink")
    rename = _read_only("rename")
    link = _read_only("link")
    create = _read_only("create")
    write = _read_only("write")
    setxattr = _read_only("setxattr")
    removexattr = _read_only("removexattr")
