"""The FUSE operations of a mount with data processes (docs/DATA_PROCESSES.md): every
request is answered as in fs.py but READ, which goes to the data process that owns the
object, as a job naming the request's `unique` and the version the name stands for.
That process writes the reply to the kernel itself, so `read` returns
`pyfuse3.REPLIED_ELSEWHERE` (a hunk of bucketfs's pyfuse3 patch) and this thread pays a
job's send per read, not the read.
"""

from __future__ import annotations

import collections
import errno
import logging
from collections.abc import Callable

import pyfuse3

from bucketfs.backends.base import BackendError
from bucketfs.cache.schema import DirEntry
from bucketfs.data_jobs import Job
from bucketfs.dispatch import DataProcesses
from bucketfs.fs import READ_STATES, Operations, fuse_errors
from bucketfs.namespace import Namespace
from bucketfs.reader import Reader

log = logging.getLogger(__name__)

#: `read_unique` and `REPLIED_ELSEWHERE`: hunk 6 of packaging/pyfuse3/build.py.
REPLIED_ELSEWHERE_PATCH = 5


def supported() -> bool:
    """Whether this pyfuse3 lets another process answer a read (bucketfs's patch)."""
    return getattr(pyfuse3, "BUCKETFS_PATCH", 0) >= REPLIED_ELSEWHERE_PATCH


class DispatchingOperations(Operations):
    """fs.Operations whose reads are answered by `data`'s processes."""

    read_unique = True  # the patched pyfuse3 passes each READ's `unique`

    def __init__(self, namespace: Namespace, reader: Reader, data: DataProcesses,
                 spawn: Callable[..., object], **options: object) -> None:
        """`reader`: the daemon's own, which reads nothing here (the data processes
        do); status and metrics read its budgets. `spawn(fn, *args)`: starts a task
        (a nursery's `start_soon`), to look a changed object up again."""
        super().__init__(namespace, reader, **options)  # type: ignore[arg-type]
        if not supported():
            raise ValueError("data processes need the pyfuse3 that `make venv` builds")
        self.data, self.spawn = data, spawn
        #: Per open handle (or, with kernel_opens, per inode: an LRU), the entry read.
        self.nodes: collections.OrderedDict[int, DirEntry] = collections.OrderedDict()
        data.on_changed = self.changed

    def opened(self, fh: int, node: DirEntry) -> None:
        self.nodes[fh] = node  # the data process keeps the read state

    @fuse_errors
    async def read(self, fh: int, off: int, size: int, unique: int = 0) -> object:
        node = self._node(fh)
        if await self.data.send(Job(unique, node.key, node.version, node.size, off, size)):
            return pyfuse3.REPLIED_ELSEWHERE
        raise pyfuse3.FUSEError(errno.EIO)  # its owner is down; started again soon

    def _node(self, fh: int) -> DirEntry:
        if not self.kernel_opens:
            return self.nodes[fh]
        node = self.nodes.get(fh)  # fh: the inode (the kernel opened the file itself)
        if node is None:
            node = self.nodes[fh] = self.file_entry(fh)
            if len(self.nodes) > READ_STATES:
                self.nodes.popitem(last=False)
        else:
            self.nodes.move_to_end(fh)
        return node

    async def release(self, fh: int) -> None:
        if not self.kernel_opens:
            self.nodes.pop(fh, None)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        await super().forget(inode_list)
        if self.kernel_opens:
            for inode, _ in inode_list:
                self.nodes.pop(inode, None)

    def changed(self, key: str) -> None:
        """A data process found `key`'s version gone from the bucket: look the name up
        again, so that new opens get the new version (its reads of the old one failed,
        as they do in one process)."""
        for node in reversed(self.nodes.values()):  # the entry a reader had just read
            if node.key == key:
                self.spawn(self._refresh, node)
                return

    async def _refresh(self, node: DirEntry) -> None:
        try:
            await self.namespace.refresh(node)
        except BackendError as exc:
            log.warning("cannot look %r up again: %s", node.key, exc)
