"""Writing cache files so that a crash at any moment leaves nothing torn under a real
name: write `NAME.<thread>.tmp`, make it durable, rename it to `NAME`. The caller records
a file in the index only after this returns; the startup sweep deletes what a crash
left in between.

`write_many` does it for many files at once with one `syncfs` of their filesystem in
place of an fsync each: a cold epoch writes a block file per small object, and one
flush for a batch costs the daemon a fraction of what a flush per file does.

Once durable, a file's pages leave the page cache (`drop_cached`): what the SSD tier
writes is also in the RAM tier and in the page cache of the mount's own file, where the
kernel serves it without the daemon. A third copy, under the tier file's name, would
double the page cache a cold epoch takes (writing 191 MiB of blocks left all 191 MiB
resident, docs/BENCHMARKS.md), charged to the daemon's memory cgroup.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

#: The C library, errno kept (chunk_holes.py takes its fallocate from it too).
libc = ctypes.CDLL(None, use_errno=True)
_syncfs = getattr(libc, "syncfs", None)


def drop_cached(fd: int) -> None:
    """Let the kernel drop the file's clean pages from the page cache. Advice only: a
    failure changes nothing."""
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_durably(path: Path, parts: Iterable[bytes]) -> None:
    temporary = _temporary(path)
    try:
        with open(temporary, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
            drop_cached(f.fileno())
        os.rename(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_many(files: Sequence[tuple[Path, Iterable[bytes]]]) -> list[BaseException | None]:
    """Write each (path, parts) durably; per file, None or what went wrong with it (its
    temporary file removed). One flush of the filesystem for all of them."""
    outcomes: list[BaseException | None] = [None] * len(files)
    written: list[int] = []
    #: Kept open until the flush, so that their pages can be dropped once clean.
    opened: list[BinaryIO] = []
    try:
        for i, (path, parts) in enumerate(files):
            temporary = _temporary(path)
            try:
                f = open(temporary, "wb")  # noqa: SIM115 (closed below, after the flush)
                opened.append(f)
                for part in parts:
                    f.write(part)
                f.flush()
                written.append(i)
            except Exception as exc:
                temporary.unlink(missing_ok=True)
                outcomes[i] = exc
        if not written:
            return outcomes
        try:
            _flush([files[i][0] for i in written])
        except Exception as exc:  # nothing is known durable: none is renamed
            for i in written:
                _temporary(files[i][0]).unlink(missing_ok=True)
                outcomes[i] = exc
            return outcomes
        for f in opened:
            drop_cached(f.fileno())
    finally:
        for f in opened:
            with contextlib.suppress(OSError):
                f.close()
    for i in written:
        path = files[i][0]
        try:
            os.rename(_temporary(path), path)
        except Exception as exc:
            _temporary(path).unlink(missing_ok=True)
            outcomes[i] = exc
    return outcomes


def _temporary(path: Path) -> Path:
    return path.with_name(f"{path.name}.{threading.get_ident():x}.tmp")


def _flush(paths: list[Path]) -> None:
    """Make the temporary files of `paths` durable: syncfs on their filesystem, else an
    fsync each."""
    if _syncfs is not None:
        fd = os.open(paths[0].parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _syncfs(fd) == 0:
                return
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        finally:
            os.close(fd)
    for path in paths:
        fd = os.open(_temporary(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
