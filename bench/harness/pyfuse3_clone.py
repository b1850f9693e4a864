"""pyfuse3 serving a clone of one FUSE connection, for `bench.fuse_clones`: whether a
pyfuse3 process (and so bucketfs's own stack) can be one of several serving one mount,
and what its dispatch (libfuse, pyfuse3's trio tasks) costs against raw_fuse's.

The driver mounts the connection and answers the kernel's INIT itself
(raw_fuse.answer_init), then starts these processes with that INIT request: each
clones the connection's descriptor, gives pyfuse3 the clone as "/dev/fd/N" (libfuse
then serves that descriptor and mounts nothing), hands its session the INIT
(`pyfuse3.take_init`, a hunk of packaging/pyfuse3/build.py), and serves raw_fuse's
fixed tree from memory (raw_fuse.MemoryBodies) until the connection ends:

    python -m bench.harness.pyfuse3_clone --fd N --table F --init F --stats F
"""

from __future__ import annotations

import argparse
import errno
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from bench.harness.raw_fuse import ROOT, VALID_S, MemoryBodies, Tree, clone, kind, ready


class TreeOperations(pyfuse3.Operations):
    """raw_fuse's tree through pyfuse3: LOOKUP, GETATTR and READ; OPEN answered ENOSYS
    (the kernel then opens files itself, and the patched pyfuse3 gives `read` the
    inode), everything else pyfuse3's default (ENOSYS)."""

    def __init__(self, tree: Tree, bodies: MemoryBodies) -> None:
        super().__init__()
        self.tree, self.bodies = tree, bodies
        self.counts: Counter[str] = Counter()
        self.attributes = {ROOT: self._attributes(ROOT, -1)}
        for ino in range(ROOT + 1, ROOT + 1 + len(tree.entry)):
            self.attributes[ino] = self._attributes(ino, tree.size.get(ino, -1))

    @staticmethod
    def _attributes(ino: int, size: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = ino
        entry.st_mode, entry.st_nlink = kind(size)
        entry.st_size = max(size, 0)
        entry.st_blksize = 4096
        entry.st_blocks = (entry.st_size + 511) // 512
        entry.entry_timeout = entry.attr_timeout = VALID_S
        return entry

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None,
                     ) -> pyfuse3.EntryAttributes:
        self.counts["LOOKUP"] += 1
        child = self.tree.children.get((parent_inode, name))
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attributes[child]

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        self.counts["GETATTR"] += 1
        return self.attributes[inode]

    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def read(self, fh: int, off: int, size: int) -> memoryview | bytes:
        self.counts["READ"] += 1
        return self.bodies.read(fh, off, size)  # fh: the inode (no OPEN preceded)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--table", type=Path, required=True)
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--tasks", type=int, default=16)
    args = parser.parse_args(argv)
    table = json.loads(args.table.read_text())
    tree = Tree(table["rows"])
    operations = TreeOperations(tree, MemoryBodies(Path(table["bodies"]), tree))
    fd = clone(args.fd)
    os.close(args.fd)
    pyfuse3.init(operations, f"/dev/fd/{fd}", set())
    pyfuse3.take_init(args.init.read_bytes())
    ready(args.stats)
    trio.run(pyfuse3.main, args.tasks, args.tasks)
    args.stats.write_text(json.dumps(operations.counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
