"""Transparent huge pages for the daemon's large buffers, through glibc's malloc.

Why: every block a cold read fetches lands in fresh memory (the GET client's buffer,
which the RAM tier then keeps), and each 4 KiB page of it costs a page fault on first
touch: a third of the daemon's CPU for a cold 1 GiB read on the benchmark's VM. With
`glibc.malloc.hugetlb=1`, glibc asks the kernel for transparent huge pages
(`MADV_HUGEPAGE`) on the memory it maps for large allocations, and a 2 MiB page is one
fault. A 4 MiB block's mapping is not 2 MiB-aligned, so about half of it gets such
pages (a cold 1 GiB read, interleaved: 1.31 -> 1.24 CPU-s per GiB in one run and
1.20 -> 1.06 in another; docs/BENCHMARKS.md, step 24). Where `huge_buffers` is on, a
large block's buffer is a mapping of its own in whole huge pages instead
(huge_buffers.py); this setting still serves everything else glibc maps.

The setting is read only when a process starts, so it goes into the daemon's
environment: the parent of `bucketfs mount` passes it to the daemon it starts, and a
foreground mount started without it runs itself again with it once. It changes nothing
where the kernel gives no huge pages (`transparent_hugepage` set to never) or the C
library is not glibc; a user who sets `glibc.malloc.hugetlb` in GLIBC_TUNABLES (0 turns
it off) keeps their choice.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

TUNABLE = "glibc.malloc.hugetlb"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

__all__ = ["TUNABLE", "environment", "run_again_with_huge_pages"]


def environment(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` with glibc asked for huge pages, or None where it is set already, the user
    chose for themselves, or it would change nothing here."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables or not _glibc() or not _kernel_gives_huge_pages():
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables
            else f"{TUNABLE}=1"}


def run_again_with_huge_pages() -> None:
    """Replace this process by itself, same command line, with huge pages asked for;
    return where nothing is to change or the new program cannot be run (the mount then
    goes on without them)."""
    env = environment(os.environ)
    if env is None:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:
        log.debug("not run again with huge pages: %s", exc)


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
