"""Holes in chunk files: a member that leaves a chunk that stays gives its room back.

A chunk file is never rewritten. A member that leaves it (evicted alone, moved into a
chunk of another layout, found damaged) used to stay as dead bytes, counted in the
budget until the chunk's last member left. Punching a hole where it was
(`fallocate(PUNCH_HOLE | KEEP_SIZE)`) frees its disk blocks at once, with no copy: the
file keeps its length and every other member its offset. A hole reads as zeros, so a
read-ahead pread over it fails that member's CRC32 and skips it, never wrong bytes.

This is what lets hinted eviction take the members of a write-through chunk one by one
(disk.py): their next uses differ, since they were fetched together, not laid out for an
order. ext4, XFS, btrfs and tmpfs punch holes. Where the filesystem cannot (`probe`,
once the tier has opened its directory, on a file of its own), nothing is punched, dead
bytes stay until their chunk goes, and the SSD tier keeps hinted blocks in block files,
as it did before.

Only whole pages inside a hole are freed; the budget counts the member's bytes as freed
all the same, as it counts a block file's data bytes and not its last page.
Thread-safety: `probe` runs while the tier opens; `punch` under the SSD tier's lock.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from bucketfs.cache.chunk_files import DATA_START
from bucketfs.cache.durable import libc

log = logging.getLogger(__name__)

_KEEP_SIZE = 0x01
_PUNCH_HOLE = 0x02
_PAGE = 4096
#: The filesystem cannot punch holes (ENOTSUP is EOPNOTSUPP on Linux).
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS}

_fallocate = getattr(libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _fallocate.restype = ctypes.c_int


def _punch(fd: int, offset: int, length: int) -> int:
    """0, or the errno of a punch that failed."""
    assert _fallocate is not None
    if _fallocate(fd, _PUNCH_HOLE | _KEEP_SIZE, offset, length) == 0:
        return 0
    return ctypes.get_errno()


class Holes:
    """Punches dead members out of the chunk files in `directory` (module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        #: Whether this filesystem punches holes: False until `probe` says it does.
        self.work = False

    def probe(self) -> None:
        """Try a hole in a file of our own in `directory` (the tier's private chunk
        directory, made before: nothing another user could have planted)."""
        self.work = _fallocate is not None and self._punches()

    def _punches(self) -> bool:
        path = self.directory / f"punch-probe-{os.getpid()}.tmp"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        except OSError:
            return False  # the tier's own writes will say what is wrong
        try:
            os.write(fd, bytes(3 * _PAGE))
            failed = _punch(fd, _PAGE, _PAGE)
        except OSError:
            return False
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        if failed:
            log.info("cache: %s cannot punch holes (%s): a member that leaves a chunk "
                     "stays as dead bytes until the chunk goes", self.directory,
                     os.strerror(failed))
        return not failed

    def punch(self, path: Path, members: Iterable[tuple[int, int]]) -> bool:
        """Punch each member's data (offset, length) out of the chunk file at `path`;
        False if any was not: the caller then counts them all as dead bytes still, even
        those punched before the one that failed (the budget errs on the safe side)."""
        if not self.work:
            return False
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False  # the chunk is gone or damaged: its reads drop it
        try:
            for offset, length in _runs(members):
                failed = _punch(fd, DATA_START + offset, length)
                if failed:
                    if failed in _UNSUPPORTED:
                        self.work = False
                    log.debug("cache: no hole punched in %s: %s", path, os.strerror(failed))
                    return False
            return True
        finally:
            os.close(fd)


def _runs(members: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent members as one range: a page two of them share is freed too."""
    runs: list[tuple[int, int]] = []
    for offset, length in sorted(members):
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + length)
        else:
            runs.append((offset, length))
    return runs
