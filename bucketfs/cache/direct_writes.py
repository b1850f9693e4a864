"""Writing a large block file past the page cache, straight from the GET's buffer.

Why: a buffered write copies the block into the page cache (fresh pages, charged to the
daemon), and the write-through then asks the kernel to drop them again, since the RAM
tier and the mount's own page cache already hold the block. `O_DIRECT` hands the
buffer's pages to the device instead: no copy and no page cache to fill and reclaim.

Direct I/O wants each piece's memory address, file offset and length aligned. The GET
client's buffer starts wherever its allocator put it (a few bytes past a page boundary
for a bytearray from glibc's mmap, on one for a mapping of huge pages from
huge_buffers.py), so the file is laid out to match it: the header is padded until the
data's file offset falls at the same place within a page as its address. Then all but
the data's first and last partial pages go straight from the buffer; those two, with the
header, are copied into small page-aligned buffers of their own; the file is cut to its
length afterwards. Where the filesystem refuses direct I/O (`EINVAL`), the caller writes
the same layout through the page cache.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any, TypeVar

PAGE = mmap.PAGESIZE
Mapping = TypeVar("Mapping", bound=mmap.mmap)

__all__ = ["PAGE", "address_of", "private_pages", "write_direct"]


#: Asks the kernel to fault a mapping's pages in when it maps them (0 where it cannot).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def private_pages(size: int, *, populate: bool = False,
                  kind: type[Mapping] = mmap.mmap) -> Mapping:  # type: ignore[assignment]
    """`size` bytes (whole pages) of page-aligned memory of this process's own, as direct
    I/O wants. Private: Python's `mmap.mmap(-1, n)` maps shared memory, which the
    kernel backs with shmem (tmpfs) pages, each first touch adding a page to a shmem
    file; private anonymous pages fault in for less. A 1 GiB object read from the SSD
    tier: 2.30 -> 1.68 CPU-s per GiB (docs/BENCHMARKS.md, step 36). `populate`: every
    page faulted in now, in one system call (MAP_POPULATE), for memory that will be
    written whole anyway: a fault per 4 KiB page taken one at a time cost a 4 MiB
    buffer filled in 512 KiB pieces 3.2-3.7 ms here, populated 2.0-2.1 (step 43).
    `kind`: mmap.mmap or a subclass of it (a GET's buffer, spare_buffers.GetBuffer)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (_POPULATE if populate else 0)
    return kind(-1, size, flags=flags)


class _Buffer(ctypes.Structure):
    """CPython's `Py_buffer` (part of the stable ABI since 3.11)."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p),
                ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
                ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
                ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_Buffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_Buffer)]
_CONTIGUOUS = 0  # PyBUF_SIMPLE: one contiguous run of bytes, or an error


def address_of(data: Any) -> int:
    """Where the bytes of a contiguous buffer (bytes, memoryview, obstore.Bytes) start.
    Only an alignment is read from it; the buffer must stay alive while it is used."""
    view = _Buffer()
    _get_buffer(data, ctypes.byref(view), _CONTIGUOUS)  # raises BufferError if not contiguous
    try:
        return view.buf or 0
    finally:
        _release_buffer(ctypes.byref(view))


def write_direct(fd: int, head: bytes, data: Any) -> None:
    """Write `head` then `data` from offset 0 of `fd` (opened with O_DIRECT), and cut the
    file to their length. `len(head)` must be congruent to `data`'s address modulo the
    page size (`address_of`). OSError as `pwritev` raises it (EINVAL: no direct I/O
    here)."""
    view = memoryview(data).cast("B")
    lead = -address_of(view) % PAGE  # data bytes before its first whole page in memory
    if (len(head) + lead) % PAGE:
        raise ValueError("header and data are not laid out for direct I/O")
    middle = max(0, len(view) - lead) // PAGE * PAGE
    if not middle:  # less than a page to go straight: all of it is copied
        lead = len(view)
    rest = view[lead + middle:]
    first = private_pages(-(-(len(head) + lead) // PAGE) * PAGE)
    last = private_pages(PAGE)
    try:
        first[:len(head)] = head
        first[len(head):len(head) + lead] = view[:lead]
        last[:len(rest)] = rest
        pieces = [first] + ([view[lead:lead + middle]] if middle else []) \
            + ([last] if rest else [])
        total = sum(len(p) for p in pieces)
        written = os.pwritev(fd, pieces, 0)
        if written != total:  # direct I/O writes whole or fails; a short write is an error
            raise OSError(f"short direct write: {written} of {total} bytes")
        os.ftruncate(fd, len(head) + len(view))
    finally:
        first.close()
        last.close()
