"""Reading an SSD block file whole, past the page cache where the filesystem allows it.

Why: a block file read through the page cache lands there first, is copied into the
daemon's buffer, and stays there as a third copy of a block that the RAM tier and the
mount's own page cache already hold. `O_DIRECT` reads the device straight into the
daemon's buffer: no copy, no page cache to fill and later reclaim. A 1 GiB object read
from the SSD tier with `dd bs=4M`: 1.02-1.08 -> 0.86-0.90 CPU-s per GiB of daemon CPU,
1,174-1,232 -> 1,260-1,314 MB/s (docs/BENCHMARKS.md, step 19). The kernel keeps direct
reads coherent with writes still in its page cache (it writes those back first).

Only files of large blocks are read so (the caller says which): the buffer is an mmap
of its own (fresh pages, unless the mapping of a block the RAM tier let go is there to
use again: spare_buffers.py), where a small file's bytes come from the heap and reuse
its memory. Small block files read either way cost the same (0.40-0.44 ms of CPU
per 100 KB block buffered, 0.405-0.45 direct: docs/BENCHMARKS.md, after step 20), so
they are read as before.

Direct I/O wants the buffer, the offset and the length aligned: the buffer is a private
anonymous mmap (page-aligned; not Python's default shared one: direct_writes.py's
`private_pages` says why), where huge pages are on placed so that the data, which
starts in the file's second page, lies in whole huge pages (huge_buffers.py: the read
pins 2 MiB pages, not 512 of 4 KiB each), and the read starts at 0 and asks for whole
pages. Where the
filesystem refuses (`EINVAL`: tmpfs before Linux 6.6, some FUSE or network
filesystems), the file is read through the page cache instead.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

from bucketfs import huge_buffers
from bucketfs.spare_buffers import spare_buffers

_PAGE = mmap.PAGESIZE

__all__ = ["read_whole"]


def read_whole(path: Path, *, direct: bool = True) -> memoryview:
    """The file's bytes (a view of a buffer of its own), past the page cache if `direct`
    and the filesystem allows it. FileNotFoundError and other OSErrors as `open` and
    `read` raise them."""
    if not direct:
        return _buffered(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return _buffered(path)
    try:
        return _read_direct(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
    return _buffered(path)


def _read_direct(fd: int) -> memoryview:
    size = os.fstat(fd).st_size
    # A block file's data starts in its second page (block_files.py's padding). The
    # mapping of a block the RAM tier let go is used again where one fits.
    view = huge_buffers.read_from(max(_PAGE, -(-size // _PAGE) * _PAGE), _PAGE,
                                  spare_buffers.reads.take)
    got = 0
    while got < size:
        # Whole pages from a page boundary; only the end of the file reads short.
        count = os.preadv(fd, [view[got:]], got)
        if count == 0:  # truncated meanwhile: the caller's header checks catch it
            break
        got += count
    return view[:got]


def _buffered(path: Path) -> memoryview:
    with open(path, "rb") as f:
        return memoryview(f.read())
