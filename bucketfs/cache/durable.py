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
resident, docs/BENCHMARKS.md), charged to the daemon's memory cgroup. A large block file
(`Direct` parts) is written past the page cache instead (direct_writes.py), so it has no
pages to drop and its bytes are not copied; where the filesystem refuses direct I/O it
is written through the page cache like the rest.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import io
import itertools
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from bucketfs.cache.direct_writes import write_direct

#: The C library, errno kept (chunk_holes.py takes its fallocate from it too).
libc = ctypes.CDLL(None, use_errno=True)
_syncfs = getattr(libc, "syncfs", None)
_DIRECT = getattr(os, "O_DIRECT", 0)
#: The most buffers one writev takes.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def drop_cached(fd: int) -> None:
    """Let the kernel drop the file's clean pages from the page cache. Advice only: a
    failure changes nothing."""
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_parts(fd: int, parts: Iterable[bytes]) -> None:
    """All of `parts`, in order, at the file's position, in as few system calls as the
    kernel takes: one `writev` for up to IOV_MAX of them. Why not a write per part: each
    call releases the GIL, and the worker thread then waits to take it back from the
    trio thread, a context switch per part (a write-through chunk has a part per file)."""
    views = (memoryview(part).cast("B") for part in parts)  # sliced by the byte below
    pending = collections.deque(view for view in views if view.nbytes)
    while pending:
        written = os.writev(fd, list(itertools.islice(pending, _IOV_MAX)))
        if written <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while written:  # drop what was written; a part written in part goes on
            head = pending[0]
            if written < len(head):
                pending[0] = head[written:]
                break
            written -= len(head)
            pending.popleft()


def write_durably(path: Path, parts: Iterable[bytes]) -> None:
    temporary = _temporary(path)
    try:
        with open(temporary, "wb", buffering=0) as f:
            write_parts(f.fileno(), parts)
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
    opened: list[io.FileIO] = []
    try:
        for i, (path, parts) in enumerate(files):
            temporary = _temporary(path)
            try:
                if isinstance(parts, Direct) and _written_direct(temporary, parts):
                    written.append(i)
                    continue
                f = open(temporary, "wb", buffering=0)  # noqa: SIM115 (closed after the flush)
                opened.append(f)
                write_parts(f.fileno(), parts)
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


class Direct(tuple):
    """A file's parts, (head, data), to write past the page cache where the filesystem
    allows it (direct_writes.py: `len(head)` congruent to data's address)."""

    __slots__ = ()


def _written_direct(temporary: Path, parts: Direct) -> bool:
    """Write a Direct file with O_DIRECT; False where the filesystem refuses (EINVAL),
    nothing left behind, so that the caller writes it through the page cache."""
    if not _DIRECT:
        return False
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                     | os.O_NOFOLLOW | _DIRECT, 0o600)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    try:
        write_direct(fd, *parts)
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
    temporary.unlink(missing_ok=True)
    return False


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
