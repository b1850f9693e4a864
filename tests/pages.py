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


def mapping_flags(address: int) -> set[str]:
    """The kernel's VmFlags of the mapping holding `address` in this process (`hg`: advised
    MADV_HUGEPAGE), from /proc/self/smaps."""
    flags: set[str] | None = None
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0] if line.strip() else ""
        if "-" in first and not first.endswith(":"):
            low, high = (int(part, 16) for part in first.split("-"))
            inside = low <= address < high
        elif inside and first == "VmFlags:":
            flags = set(line.split()[1:])
    if flags is None:
        raise AssertionError(f"{address:#x} is in no mapping")
    return flags
