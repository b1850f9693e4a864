"""Large block buffers in whole transparent huge pages: one fault per 2 MiB, not 512.

Why: every page of fresh memory costs a fault on its first touch. glibc's huge-page
advice (huge_pages.py) covers only about half of a 4 MiB block, whose mapping is a page
longer than 4 MiB and not 2 MiB-aligned. A private anonymous mapping of exactly the
block's size is aligned by the kernel (Linux 6.7 on, for lengths that are multiples of
2 MiB) and, advised `MADV_HUGEPAGE`, is two huge pages. Two users:

- A large GET's body (`fresh`, through spare_buffers.py): a mapping as long as its size
  class (`size_class`), a 4 MiB block's exactly.
- The SSD tier's direct reads (`read_from`). A block file's data starts in the file's
  second page, so that page is placed just below a 2 MiB boundary and only the data
  advised (advised, the header's 2 MiB range would be a huge page of its own).

Where freed memory stays with the machine (bare metal, most cloud VMs), a cold 1 GiB
read cost 2.49 -> 1.99 CPU-s per GiB and a read from the SSD tier 1.68 -> 1.03. But a
VM whose host takes freed memory back (virtio-balloon free page reporting, in blocks of
2 MiB and up) hands out every fresh huge page unbacked, and the host faults in its 512
pages one by one, where 4 KiB pages come from memory freed moments before: there both
reads cost more and varied widely (docs/BENCHMARKS.md, step 37). So
`huge_buffers = "auto"` (the default) turns them on unless the host takes freed memory
back; "always" and "never" decide for the user. glibc's own huge-page advice
(huge_pages.py) follows the same decision.

Huge pages hold no more memory than the block: a GET's mapping is its length rounded to
whole pages, a tail block under 2 MiB gets ordinary pages, and a read's extra 2 MiB is
never touched. Where the kernel gives no huge pages, the advice is refused or ignored
and the buffers are ordinary memory.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import Callable
from pathlib import Path

from bucketfs import huge_pages
from bucketfs.cache.direct_writes import Mapping, address_of, private_pages

log = logging.getLogger(__name__)

HUGE_PAGE = 2 * 1024 * 1024
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)

__all__ = ["HUGE_PAGE", "ReadMapping", "choose", "fresh", "read_from", "settings",
           "size_class"]


def size_class(size: int) -> int:
    """The length of a large block's buffer for `size` bytes: `size` rounded up to an
    eighth of the power of two below it (so at most 1/8 longer; a power of two is its
    own class; never under a page). Buffers of one class serve any size in it, so
    that files each of its own size share them (spare_buffers.py)."""
    step = 1 << max(12, size.bit_length() - 4)
    return -(-size // step) * step


class ReadMapping(mmap.mmap):
    """The mapping of a block read from the SSD tier in ordinary pages (`read_from`):
    its own type, so that the RAM tier charges it whole (its header page and its size
    class's slack with the block: spare_buffers.held_bytes) and the spare pool knows
    it."""

    __slots__ = ()


class _Settings:
    #: Whether large blocks get huge pages (mount.py sets it from the option).
    enabled: bool = False


settings = _Settings()


def _advise(memory: mmap.mmap, start: int, length: int) -> None:
    if _ADVICE is None or length < HUGE_PAGE:
        return
    # A kernel without transparent huge pages refuses: ordinary pages then.
    with contextlib.suppress(OSError):
        memory.madvise(_ADVICE, start, length)


def fresh(size: int, kind: type[Mapping] = mmap.mmap) -> Mapping:  # type: ignore[assignment]
    """A buffer of `size` bytes for a GET's body (of `kind`, mmap.mmap or a subclass),
    advised huge."""
    memory = private_pages(size, kind=kind)  # not shared memory: no huge pages there
    _advise(memory, 0, size)
    return memory


def _no_spare(length: int) -> mmap.mmap | None:
    return None


def read_from(size: int, lead: int,
              spare: Callable[[int], mmap.mmap | None] = _no_spare) -> memoryview:
    """`size` bytes of page-aligned memory (a direct read asks for whole pages: the
    caller rounds), for a file whose data starts `lead` bytes in (a multiple of the
    page size). Where huge pages are on and the data fills one, the bytes from `lead`
    start on a 2 MiB boundary, advised huge: the mapping then reaches 2 MiB past what
    is handed out, a part nothing touches, which holds no memory. The mapping is as
    long as `size`'s class (`size_class`), the view handed out `size` long: a mapping
    serves reads of any size in its class. `spare(length)`: a mapping of that length to
    use again (one this function made for a read of the same class, as spare_buffers.py
    keeps them), or None for a fresh one: in ordinary pages a `ReadMapping`."""
    huge = settings.enabled and size - lead >= HUGE_PAGE
    length = size_class(size) + HUGE_PAGE if huge else size_class(size)
    memory = spare(length)
    fresh = memory is None
    if memory is None:
        memory = private_pages(length) if huge else private_pages(length, kind=ReadMapping)
    if not huge:
        return memoryview(memory)[:size]
    skip = -(address_of(memory) + lead) % HUGE_PAGE
    if fresh:  # a mapping used again was advised when it was made
        _advise(memory, skip + lead, (size - lead) // HUGE_PAGE * HUGE_PAGE)
    return memoryview(memory)[skip:skip + size]


def choose(option: str, sys_root: Path = Path("/sys")) -> bool:
    """Whether large blocks get huge pages, for the `huge_buffers` option; logged once."""
    settings.enabled = huge_pages.wanted(option, sys_root)
    if option == "auto":
        why = ("freed memory stays with this machine" if settings.enabled
               else "the host takes freed memory back (free page reporting)")
    else:
        why = f"huge_buffers = {option}"
    log.info("large block buffers in huge pages: %s (%s)",
             "yes" if settings.enabled else "no", why)
    return settings.enabled
