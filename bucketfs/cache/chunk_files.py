"""Chunk files on disk: their format, the open descriptors, and passes over them.

`cache_dir/chunks/<id:016x>.chk`: a header (magic, chunk id, data length) padded to
`DATA_START`, then the members' bytes back to back. Ids grow and a running tier never
reuses one, so an open file descriptor can never name another chunk. What is in a chunk,
and where, is in the index (schema.py `ChunkRecord`, `Packed`); chunks.py keeps that.

Python memory here is bounded: an LRU of `OPEN_CHUNKS` open descriptors, where each of
the last `TRACKED_RUNS` chunks read was last read (to tell a sequential pass from a
random one), the read-ahead preads in flight (at most one per disk thread) and the last
`RECENT_PASSES` done (a few MiB each). Thread-safe: called from the SSD tier's worker
threads, each structure under its own lock.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bucketfs.cache.durable import write_durably

MAGIC = b"BFSK1\n"
_HEADER = struct.Struct("<6sQQ")  # magic, chunk id, data bytes
DATA_START = 32
#: Open chunk files kept (one descriptor each).
OPEN_CHUNKS = 64
#: Chunks whose last read position is remembered.
TRACKED_RUNS = 256
#: Seconds a read waits for a read-ahead pread that covers it (then reads itself).
PASS_WAIT = 30.0
#: Read-ahead preads kept after they are done (a chunk each, a few MiB).
RECENT_PASSES = 4


def chunk_file_name(chunk: int) -> str:
    return f"{chunk:016x}.chk"


def write_chunk_file(path: Path, chunk: int, parts: list[bytes]) -> None:
    """Write a chunk file durably (tmp, fsync, rename): header, then the members."""
    size = sum(len(p) for p in parts)
    write_durably(path, [_HEADER.pack(MAGIC, chunk, size).ljust(DATA_START, b"\0"), *parts])


class ChunkUnreadable(Exception):
    """A chunk file that is missing or is not the chunk its name says."""


@dataclass(eq=False, slots=True)
class _Fd:
    fd: int
    users: int = 0
    retired: bool = False


class OpenChunks:
    """A bounded LRU of open chunk files. A descriptor is closed only once no reader
    uses it, so a pread never meets a closed (or reused) descriptor."""

    def __init__(self, path_of: Callable[[int], Path], limit: int = OPEN_CHUNKS) -> None:
        self._path_of = path_of
        self._limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[int, _Fd] = OrderedDict()

    @contextlib.contextmanager
    def open(self, chunk: int) -> Iterator[int]:
        with self._lock:
            handle = self._open.get(chunk)
            if handle is not None:
                self._open.move_to_end(chunk)
                handle.users += 1
        if handle is None:
            handle = self._insert(chunk, self._open_checked(chunk))
        try:
            yield handle.fd
        finally:
            with self._lock:
                handle.users -= 1
                if handle.retired and handle.users == 0:
                    os.close(handle.fd)

    def _open_checked(self, chunk: int) -> int:
        try:
            fd = os.open(self._path_of(chunk), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ChunkUnreadable("its file is missing") from None
        try:
            header = os.pread(fd, _HEADER.size, 0)
            if len(header) != _HEADER.size or _HEADER.unpack(header)[:2] != (MAGIC, chunk):
                raise ChunkUnreadable("bad header")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _insert(self, chunk: int, fd: int) -> _Fd:
        with self._lock:
            handle = self._open.get(chunk)
            if handle is not None:  # another reader opened it meanwhile: use theirs
                os.close(fd)
            else:
                handle = self._open[chunk] = _Fd(fd)
                while len(self._open) > self._limit:
                    self._retire(self._open.popitem(last=False)[1])
            handle.users += 1
            return handle

    @staticmethod
    def _retire(handle: _Fd) -> None:  # lock held
        handle.retired = True
        if handle.users == 0:
            os.close(handle.fd)

    def forget(self, chunk: int) -> None:
        with self._lock:
            handle = self._open.pop(chunk, None)
            if handle is not None:
                self._retire(handle)

    def close(self) -> None:
        with self._lock:
            for handle in self._open.values():
                self._retire(handle)
            self._open.clear()


@dataclass(eq=False, slots=True)
class _Pass:
    """A read-ahead pread of [start, stop) of one chunk, in flight or just done."""

    start: int
    stop: int
    done: threading.Event = field(default_factory=threading.Event)
    raw: bytes | None = None


class Passes:
    """Sequential passes over chunks. Remembers where the last read of each recently
    read chunk ended: a read at 0 or there starts or continues a pass, and reads ahead.
    Keeps the read-ahead preads in flight and the last few done: a read of a member one
    of them covers takes its bytes from there instead of reading them again. DataLoader
    workers read neighbouring files at once, and ask for the next ones before the pass's
    reader has put them in RAM."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ends: OrderedDict[int, int] = OrderedDict()
        self._inflight: dict[int, list[_Pass]] = {}
        self._recent: OrderedDict[_Pass, int] = OrderedDict()  # done pass -> its chunk

    def continues(self, chunk: int, offset: int, *, from_start: bool = True) -> bool:
        """Whether a read at `offset` continues a pass (or, `from_start`, begins one
        at 0)."""
        with self._lock:
            return (from_start and offset == 0) or self._ends.get(chunk) == offset

    def covering(self, chunk: int, start: int, end: int) -> _Pass | None:
        with self._lock:
            recent = [p for p, c in self._recent.items() if c == chunk]
            for shared in [*self._inflight.get(chunk, ()), *recent]:
                if shared.start <= start and end <= shared.stop:
                    return shared
        return None

    def begin(self, chunk: int, start: int, stop: int) -> _Pass:
        with self._lock:
            shared = _Pass(start, stop)
            self._inflight.setdefault(chunk, []).append(shared)
            return shared

    def finished(self, chunk: int, stop: int, shared: _Pass | None, raw: bytes | None,
                 ) -> None:
        """A read of the chunk up to `stop` ended (`raw`: its bytes, None if it failed)."""
        with self._lock:
            self._ends[chunk] = stop
            self._ends.move_to_end(chunk)
            while len(self._ends) > TRACKED_RUNS:
                self._ends.popitem(last=False)
            if shared is not None:
                others = self._inflight[chunk]
                others.remove(shared)
                if not others:
                    del self._inflight[chunk]
                shared.raw = raw
                if raw is not None:
                    self._recent[shared] = chunk
                    while len(self._recent) > RECENT_PASSES:
                        self._recent.popitem(last=False)
        if shared is not None:
            shared.done.set()

    def forget(self, chunk: int) -> None:
        with self._lock:
            self._ends.pop(chunk, None)
            for shared in [p for p, c in self._recent.items() if c == chunk]:
                del self._recent[shared]
