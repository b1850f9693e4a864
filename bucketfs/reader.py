"""Reads of open files: ranged GETs, read-ahead, and the memory budget that bounds it.

Each open handle pins the object version it saw at open, so every byte it returns
comes from that one version. A handle keeps a contiguous run of `Part`s (fetched or
in flight) starting at or before the reader's position. Sequential reads extend the
run ahead of the reader as `prefetch.readahead` decides; a seek drops it. Small objects
are fetched whole by one GET. Every byte buffered counts against one `ByteBudget`
shared by all handles; when it is spent, reads fall back to fetching exactly what was
asked for, so memory stays bounded however many files are open.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from bucketfs.backends.store import ObjectStore
from bucketfs.prefetch.readahead import SequentialWindow

log = logging.getLogger(__name__)


class ByteBudget:
    """Bytes that read-ahead may hold, across every open file."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0

    def try_acquire(self, amount: int) -> bool:
        if self.used + amount > self.limit:
            return False
        self.used += amount
        self.peak = max(self.peak, self.used)
        return True

    def release(self, amount: int) -> None:
        self.used -= amount
        assert self.used >= 0, "released more than was acquired"


@dataclass(eq=False, slots=True)
class Part:
    start: int
    end: int
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes = b""
    error: BaseException | None = None
    #: Set when no handle wants the part any more; its budget is returned as soon as
    #: the fetch (if still running) has finished, so in-flight bytes stay counted.
    dropped: bool = False


@dataclass(frozen=True, slots=True)
class ReadSettings:
    part_size: int = 8 * 1024**2
    readahead_initial: int = 1024**2
    readahead_max: int = 64 * 1024**2
    small_file_size: int = 4 * 1024**2


class OpenFile:
    def __init__(self, key: str, version: str, size: int, settings: ReadSettings) -> None:
        self.key = key
        self.version = version
        self.size = size
        initial = min(settings.readahead_initial, settings.readahead_max)
        self.window = SequentialWindow(size, initial=initial, maximum=settings.readahead_max)
        #: Contiguous, ascending: parts[i].end == parts[i + 1].start.
        self.parts: list[Part] = []


class Reader:
    """Serves reads for every open handle of one mount."""

    def __init__(
        self, store: ObjectStore, budget: ByteBudget, settings: ReadSettings,
        nursery: trio.Nursery,
    ) -> None:
        self.store = store
        self.budget = budget
        self.settings = settings
        self.nursery = nursery

    def open(self, key: str, version: str, size: int) -> OpenFile:
        return OpenFile(key, version, size, self.settings)

    def close(self, handle: OpenFile) -> None:
        self._drop(handle, len(handle.parts))

    async def read(self, handle: OpenFile, offset: int, length: int) -> bytes:
        end = min(offset + length, handle.size)
        if offset >= end:
            return b""
        parts = handle.parts
        buffered = bool(parts) and parts[0].start <= offset < parts[-1].end
        plan = handle.window.on_read(offset, end, parts[-1].end if buffered else offset)
        if buffered:
            self._extend(handle, parts[-1].end, plan.fetch_until)
        elif not (parts and offset < parts[0].start and plan.sequential):
            # A seek (or the first read): what is buffered is of no use. A read that lands
            # just behind the run is a straggler of the kernel's own read-ahead, and is
            # served below without disturbing the run.
            self._drop(handle, len(parts))
            if handle.size <= self.settings.small_file_size:
                self._extend(handle, offset, handle.size)  # one GET for the whole object
            elif plan.sequential:
                self._extend(handle, offset, plan.fetch_until)
        if not (parts and parts[0].start <= offset and end <= parts[-1].end):
            # Not buffered, and no budget to buffer it: fetch exactly what was asked for.
            return await self.store.get_range(handle.key, handle.version, offset, end - offset)
        data = await self._copy(parts, offset, end)
        # Parts the reader has moved past are not needed again.
        consumed = 0
        while consumed < len(parts) and parts[consumed].end <= end:
            consumed += 1
        self._drop(handle, consumed)
        return data

    def _extend(self, handle: OpenFile, start: int, until: int) -> None:
        """Queue parts covering [start, until) as far as the budget allows."""
        while start < until:
            end = min(until, start + self.settings.part_size)
            if not self.budget.try_acquire(end - start):
                return
            part = Part(start, end)
            handle.parts.append(part)
            self.nursery.start_soon(self._fetch, handle.key, handle.version, part)
            start = end

    async def _fetch(self, key: str, version: str, part: Part) -> None:
        try:
            part.data = await self.store.get_range(key, version, part.start, part.end - part.start)
        except Exception as exc:  # delivered to the reader that needs these bytes
            part.error = exc
        finally:
            part.done.set()
            if part.dropped:
                self._release(part)

    async def _copy(self, parts: list[Part], start: int, end: int) -> bytes:
        chunks = []
        for part in list(parts):
            if part.end <= start or part.start >= end:
                continue
            await part.done.wait()
            if part.error is not None:
                raise part.error
            chunks.append(part.data[max(start, part.start) - part.start:min(end, part.end)
                                    - part.start])
        data = b"".join(chunks)
        if len(data) != end - start:  # parts are contiguous; anything else is a bug
            raise RuntimeError(f"assembled {len(data)} bytes for a read of {end - start}")
        return data

    def _drop(self, handle: OpenFile, count: int) -> None:
        for part in handle.parts[:count]:
            part.dropped = True
            if part.done.is_set():
                self._release(part)
        del handle.parts[:count]

    def _release(self, part: Part) -> None:
        # The bytes are not cleared: a concurrent read may still be copying from them.
        self.budget.release(part.end - part.start)
