"""Replies written straight to a mount's /dev/fuse descriptor, by a process that shares
it and answers requests pyfuse3 handed over (`REPLIED_ELSEWHERE`): the data processes
(data_process.py) and, for reads a dead one held, their dispatcher (dispatch.py).

The kernel matches a reply to its request by `unique`. It refuses one for a request
already answered or given up on (ENOENT), and every one once the mount has ended
(ENODEV): either way nobody waits for it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
from collections.abc import Iterable

#: fuse_out_header: the reply's length, a negated errno (0: success), the unique.
OUT_HEADER = struct.Struct("<IiQ")


def reply(fd: int, unique: int, data: bytes | memoryview) -> None:
    """Answer request `unique` with `data` (bytes, or a memoryview of bytes), in one
    write. Raises OSError."""
    os.writev(fd, [OUT_HEADER.pack(OUT_HEADER.size + len(data), 0, unique), data])


def fail(fd: int, unique: int, code: int = errno.EIO) -> None:
    """Answer request `unique` with the error `code`; one that cannot go is dropped."""
    with contextlib.suppress(OSError):
        os.write(fd, OUT_HEADER.pack(OUT_HEADER.size, -code, unique))


def fail_all(fd: int, uniques: Iterable[int]) -> int:
    """Answer EIO each of `uniques` still waiting; how many were."""
    answered = 0
    for unique in uniques:
        try:
            os.write(fd, OUT_HEADER.pack(OUT_HEADER.size, -errno.EIO, unique))
            answered += 1
        except OSError as exc:
            if exc.errno == errno.ENODEV:  # unmounted: nobody waits any more
                break
            # ENOENT: answered already, the usual case for all but the last few
    return answered
