"""Whether the daemon's memory gets transparent huge pages, and glibc's malloc asked for
them where it does.

Why: every block a cold read fetches lands in fresh memory (the GET client's buffer,
which the RAM tier then keeps), and each 4 KiB page of it costs a page fault on first
touch: a third of the daemon's CPU for a cold 1 GiB read on the benchmark's VM. With
`glibc.malloc.hugetlb=1`, glibc asks the kernel for transparent huge pages
(`MADV_HUGEPAGE`) on the memory it maps for large allocations and on its heap, and a
2 MiB page is one fault (docs/BENCHMARKS.md, step 24). Where `huge_buffers` is on, a
large block's buffer is a mapping of its own in whole huge pages instead
(huge_buffers.py); this setting serves everything else glibc hands out.

But a VM whose host takes freed memory back (virtio-balloon free page reporting, in
blocks of 2 MiB and up) hands out every fresh huge page unbacked, and the host faults in
its 512 pages one by one, where 4 KiB pages come from memory freed moments before. There
zeroing the heap's huge pages, grown as the RAM tier fills with small files, took 12-13%
of the daemon's CPU in a cold pass of ~100 KB files, and a body's first touch cost
0.10-0.16 ms against 0.06 with 4 KiB pages (docs/BENCHMARKS.md, step 46). So glibc is
asked exactly where large block buffers get huge pages: the `huge_buffers` option
(`wanted`) decides both.

The setting is read only when a process starts, so it goes into the daemon's
environment: the parent of `bucketfs mount` passes it to the daemon it starts, and a
foreground mount started without it runs itself again with it once. It changes nothing
where the kernel gives no huge pages (`transparent_hugepage` set to never) or the C
library is not glibc; a user who sets `glibc.malloc.hugetlb` in GLIBC_TUNABLES (0 turns
it off) keeps their choice.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

TUNABLE = "glibc.malloc.hugetlb"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: virtio's balloon device, and its feature bit VIRTIO_BALLOON_F_REPORTING.
_BALLOON, _REPORTING = "0x0005", 5
#: The order of a huge page in 4 KiB pages: free page reporting from it or below hands
#: huge pages back to the host.
_HUGE_ORDER = 9

__all__ = ["TUNABLE", "environment", "host_takes_freed_memory",
           "run_again_with_huge_pages", "wanted"]


def wanted(option: str, sys_root: Path = Path("/sys")) -> bool:
    """Whether the daemon's memory should get huge pages, for the `huge_buffers` option:
    `auto` unless the host takes freed memory back, `always`, `never`."""
    if option == "auto":
        return not host_takes_freed_memory(sys_root)
    return option == "always"


def environment(env: Mapping[str, str], option: str = "auto") -> dict[str, str] | None:
    """`env` with glibc asked for huge pages, or None where it is set already, the user
    chose for themselves, the `huge_buffers` option says no, or it would change nothing
    here."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if (TUNABLE in tunables or not _glibc() or not _kernel_gives_huge_pages()
            or not wanted(option)):
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables
            else f"{TUNABLE}=1"}


def run_again_with_huge_pages(option: str) -> None:
    """Replace this process by itself, same command line, with huge pages asked for;
    return where nothing is to change or the new program cannot be run (the mount then
    goes on without them)."""
    env = environment(os.environ, option)
    if env is None:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:
        log.debug("not run again with huge pages: %s", exc)


def host_takes_freed_memory(sys_root: Path = Path("/sys")) -> bool:
    """Whether this machine's host takes back the memory its guest frees, in blocks a
    huge page comes from: a virtio balloon reporting free pages, from 2 MiB or less."""
    order_file = sys_root / "module/page_reporting/parameters/page_reporting_order"
    try:
        order = int(order_file.read_text())
    except (OSError, ValueError):
        return False  # no free page reporting in this kernel
    if not 0 <= order <= _HUGE_ORDER:
        return False
    for device in (sys_root / "bus/virtio/devices").glob("*"):
        try:
            if (device / "device").read_text().strip() != _BALLOON:
                continue
            features = (device / "features").read_text().strip()
        except OSError:
            continue
        if len(features) > _REPORTING and features[_REPORTING] == "1":
            return True
    return False


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


def _kernel_gives_huge_pages() -> bool:
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


#: glibc's M_MMAP_THRESHOLD (malloc.h), and the size from which blocks get their own mmap.
_M_MMAP_THRESHOLD = -3
_MMAP_FROM = 1024 * 1024


def return_freed_blocks_to_the_system() -> None:
    """Cache blocks (up to a few MiB each) come and go all the time. glibc raises its mmap
    threshold to the size of each mmapped block freed (up to 32 MiB), after which such
    blocks come from the heap, whose freed memory it keeps: a serving process's RSS then drifts
    past its cache budgets (195-284 MiB against a 190 MiB bound under tests/test_load.py,
    147-154 MiB with this). A fixed threshold keeps every block from 1 MiB an mmap of its
    own, returned when freed. Not lower: the GET client's own short-lived buffers of a
    large read are smaller, and as mmaps each came back as fresh pages to fault in (at
    256 KiB, a cold 1 GiB read cost the daemon 1.37 CPU-s RAM only and 1.84 with the SSD
    tier, against 1.2 and 1.63-1.75 at 1 MiB; docs/BENCHMARKS.md, step 17). Each process that
    holds blocks (the daemon, its data processes) calls it. Other C libraries: left as
    they are."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_FROM)
    except (OSError, AttributeError):
        log.debug("not glibc: the allocator keeps its defaults")
