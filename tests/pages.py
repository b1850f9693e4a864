"""What of a file the page cache holds: for tests that a tier's files leave it, and that
direct reads never enter it."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path


def resident_bytes(path: Path) -> int:
    """How much of the file the page cache holds (mincore over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = path.stat().st_size, mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
            assert libc.mincore(address, size, pages) == 0, os.strerror(ctypes.get_errno())
            return sum(p & 1 for p in pages) * page
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
