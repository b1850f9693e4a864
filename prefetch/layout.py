"""Chunk layout for the SSD tier, after LCache (a data-loading cache that packs small
samples into large chunks in the order they will be read).

Reading thousands of ~100 KB files in a shuffled order is random I/O; reading the same
bytes as a few MiB chunks laid out in that order is sequential (LCache measures 4 MB
reads 5-7x faster than 128 KB ones). So small files are packed into chunks of about
`chunk_bytes`, in the order they will be read:

- `plan_chunks(order)`: a whole layout from a known order. Files go into chunks in
  order of first use; a chunk is closed when the next file would take it past
  `chunk_bytes` (a chunk holds at least one file). Files of `small_limit` bytes or more
  are not packed (they are already read in large blocks), nor are empty files (nothing
  to read) or a file's later occurrences (it is packed where it is first read).
- `NextEpochPacker`: the log for the next epoch is built from what was just read (the
  bytes are at hand, no second GET). Fed each file as it is read, it emits a chunk as
  soon as one is complete. Without the next epoch's order, chunks follow the read order
  and are emitted when they reach `chunk_bytes`. Once the next order is known, the
  layout is `plan_chunks(next order)` and a planned chunk is emitted when all its files
  have been read; at the end of the epoch, `flush` packs the files read but not emitted
  yet (their chunks were incomplete: some files were never read) in next-epoch order.
  The plan for a million files takes seconds, so it is made apart (`plan`, safe in
  another thread) and put to use in one step (`use`). While a next order is known to
  be on its way (`expect_next`), files read are kept for it rather than cut in read
  order. A file that is laid out where the next order wants it already is `settle`d:
  its planned chunk goes without it.

Pure planning: a chunk is a list of `Placement(key, offset, length)`; the daemon reads
the files' bytes, writes the chunk file, records where each file sits in its index, and
reclaims chunks once they have been consumed.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_SMALL_LIMIT",
    "ChunkPlan",
    "NextEpochPacker",
    "NextPlan",
    "Placement",
    "plan_chunks",
]

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_SMALL_LIMIT = 1 << 20


class Placement(NamedTuple):
    """Where one file's bytes sit in a chunk."""

    key: Hashable
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    files: tuple[Placement, ...]
    #: Where the chunk goes in the log: the position, in the order it was laid out by,
    #: of its first file (the next epoch's order, or the read order). Sorting chunks on
    #: it gives the order they will be read in.
    sequence: int

    @property
    def size(self) -> int:
        return sum(file.length for file in self.files)


def _check(chunk_bytes: int, small_limit: int) -> None:
    if chunk_bytes <= 0 or small_limit <= 0:
        raise ValueError("chunk_bytes and small_limit must be > 0")


class _Cutter:
    """Appends files to the open chunk; closes it when the next file would not fit."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.files: list[Placement] = []
        self.used = 0
        self.sequence = 0

    def add(self, key: Hashable, size: int, sequence: int) -> ChunkPlan | None:
        closed = None
        if self.files and self.used + size > self.chunk_bytes:
            closed = self.close()
        if not self.files:
            self.sequence = sequence
        self.files.append(Placement(key, self.used, size))
        self.used += size
        return closed

    def close(self) -> ChunkPlan | None:
        if not self.files:
            return None
        chunk = ChunkPlan(tuple(self.files), self.sequence)
        self.files, self.used = [], 0
        return chunk


def plan_chunks(order: Iterable[tuple[Hashable, int]], *,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                small_limit: int = DEFAULT_SMALL_LIMIT,
                exclude: Container[Hashable] = ()) -> list[ChunkPlan]:
    """The chunk layout of the small files of `order` ((key, size) pairs), in read
    order, leaving out the keys in `exclude` (packed already). See the module docstring
    for what is packed. A chunk's `sequence` is its first file's position in `order`."""
    _check(chunk_bytes, small_limit)
    cutter = _Cutter(chunk_bytes)
    chunks: list[ChunkPlan] = []
    seen: set[Hashable] = set()
    for position, (key, size) in enumerate(order):
        if not 0 < size < small_limit or key in seen or key in exclude:
            continue
        seen.add(key)
        closed = cutter.add(key, size, position)
        if closed is not None:
            chunks.append(closed)
    last = cutter.close()
    if last is not None:
        chunks.append(last)
    return chunks


@dataclass(frozen=True, slots=True)
class NextPlan:
    """The next epoch's layout, planned from its order (`NextEpochPacker.plan`)."""

    chunks: list[ChunkPlan]
    #: key -> the index of its chunk in `chunks`
    chunk_of: dict[Hashable, int]
    #: key -> its first position in the order
    position_of: dict[Hashable, int]


class _Planned:
    """A chunk of the next epoch's layout and which of its files were read."""

    __slots__ = ("chunk", "emitted", "seen")

    def __init__(self, chunk: ChunkPlan) -> None:
        self.chunk = chunk
        self.seen: set[Hashable] = set()
        self.emitted = False


class NextEpochPacker:
    """Builds the next epoch's log from the files read in this one. Call `add` for
    each file as it is read, `set_next_order` (or `use(plan(order))`) when the next
    epoch's order arrives (any time), `flush` at the end of the epoch. Each file is
    packed at most once."""

    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 small_limit: int = DEFAULT_SMALL_LIMIT,
                 next_order: Sequence[tuple[Hashable, int]] | None = None) -> None:
        _check(chunk_bytes, small_limit)
        self.chunk_bytes = chunk_bytes
        self.small_limit = small_limit
        self._packed: set[Hashable] = set()  # emitted in a chunk, or settled
        self._reads = 0  # files added so far: the sequence in read order
        self._cutter = _Cutter(chunk_bytes)  # read-order mode only
        #: Read while the next order is expected: key -> (size, sequence, packed already).
        self._held: dict[Hashable, tuple[int, int, bool]] = {}
        self._expecting = False
        self._planned: list[_Planned] | None = None
        self._chunk_of: dict[Hashable, int] = {}  # key -> its planned chunk
        self._position_of: dict[Hashable, int] = {}  # key -> its place in the next order
        if next_order is not None:
            self.set_next_order(next_order)

    @property
    def planned(self) -> bool:
        """The next epoch's order is known: chunks follow it."""
        return self._planned is not None

    @property
    def expecting(self) -> bool:
        """The next epoch's order is on its way (`expect_next`) and not here yet."""
        return self._expecting

    def plan(self, order: Sequence[tuple[Hashable, int]]) -> NextPlan:
        """The layout of the next epoch's `order`, for `use`. Reads nothing but the
        packer's settings, so it may run in another thread (a million files take
        seconds)."""
        chunks = plan_chunks(order, chunk_bytes=self.chunk_bytes,
                             small_limit=self.small_limit)
        chunk_of = {file.key: i for i, chunk in enumerate(chunks) for file in chunk.files}
        position_of: dict[Hashable, int] = {}
        for position, (key, _) in enumerate(order):
            position_of.setdefault(key, position)
        return NextPlan(chunks, chunk_of, position_of)

    def set_next_order(self, order: Sequence[tuple[Hashable, int]]) -> list[ChunkPlan]:
        """`use(plan(order))`."""
        return self.use(self.plan(order))

    def expect_next(self) -> None:
        """The next epoch's order is on its way: until it comes (`use`), the files read
        are kept instead of cut into read-order chunks that it would make wrong. Files
        laid out already (`add(packed=True)`) are kept too: the next order may want
        them elsewhere."""
        if self._planned is None:
            self._expecting = True

    def use(self, plan: NextPlan, *, settled: Iterable[Hashable] = ()) -> list[ChunkPlan]:
        """Lay out the rest by the next epoch's order. Files already emitted, and the
        `settled` ones (laid out where the plan wants them already), stay where they
        are and planned chunks go without them; files read but not emitted yet move
        into the new layout. Returns the chunks this completes."""
        waiting = [file.key for file in self._cutter.files] + list(self._held)
        for planned in self._planned or ():  # an earlier next order, replaced
            if not planned.emitted:
                waiting += [f.key for f in planned.chunk.files if f.key in planned.seen]
        self._packed.update(settled)
        self._cutter = _Cutter(self.chunk_bytes)
        self._held = {}
        self._expecting = False
        self._planned = [_Planned(chunk) for chunk in plan.chunks]
        self._chunk_of = plan.chunk_of
        self._position_of = plan.position_of
        done = self._exclude(self._packed)
        for key in waiting:
            if key not in self._packed:
                done += self._add_planned(key)
        return done

    def add(self, key: Hashable, size: int, *, packed: bool = False) -> list[ChunkPlan]:
        """A file was read (its bytes are at hand). `packed`: it is laid out in a chunk
        already and is given here to be laid out anew; while the next order is
        expected, such a file waits for it and is never packed in read order.
        Returns the chunks now complete."""
        self._reads += 1
        if not 0 < size < self.small_limit or key in self._packed:
            return []
        if self._planned is not None:
            return self._add_planned(key)
        if self._expecting:
            if key not in self._held and all(file.key != key for file in self._cutter.files):
                self._held[key] = (size, self._reads - 1, packed)
            return []
        if any(file.key == key for file in self._cutter.files):
            return []
        closed = self._cutter.add(key, size, self._reads - 1)
        if closed is None:
            return []
        self._packed.update(file.key for file in closed.files)
        return [closed]

    def settle(self, keys: Iterable[Hashable]) -> list[ChunkPlan]:
        """Once the next order is known: these files are laid out where it wants them
        already, so they are not packed again and the planned chunks waiting for them
        go without them. Returns the chunks this completes. (Before, a no-op.)"""
        if self._planned is None:
            return []
        fresh = [key for key in keys if key not in self._packed]
        self._packed.update(fresh)
        return self._exclude(fresh)

    def waiting(self) -> list[Hashable]:
        """The files read and not packed yet."""
        keys = [file.key for file in self._cutter.files] + list(self._held)
        for planned in self._planned or ():
            if not planned.emitted:
                keys += [f.key for f in planned.chunk.files if f.key in planned.seen]
        return keys

    def flush(self) -> list[ChunkPlan]:
        """End of the epoch: chunks from every file read and not emitted yet, in the
        next epoch's order (or the read order), cut again at `chunk_bytes`. Files that
        waited for a next order that never came are packed in read order, but for
        those laid out already, which stay where they are."""
        if self._planned is None:
            cutter, chunks = self._cutter, []
            for key, (size, sequence, packed) in self._held.items():
                if not packed:
                    closed = cutter.add(key, size, sequence)
                    if closed is not None:
                        chunks.append(closed)
            self._held = {}
            self._expecting = False
            last = cutter.close()
            if last is not None:
                chunks.append(last)
        else:
            cutter = _Cutter(self.chunk_bytes)
            chunks = []
            for planned in self._planned:
                if planned.emitted:
                    continue
                for file in planned.chunk.files:
                    if file.key in planned.seen:
                        closed = cutter.add(file.key, file.length,
                                            self._position_of[file.key])
                        if closed is not None:
                            chunks.append(closed)
                planned.emitted = True
            last = cutter.close()
            if last is not None:
                chunks.append(last)
        for chunk in chunks:
            self._packed.update(file.key for file in chunk.files)
        return chunks

    def _add_planned(self, key: Hashable) -> list[ChunkPlan]:
        assert self._planned is not None
        index = self._chunk_of.get(key)
        if index is None:
            return []  # not read next epoch: it stays a file of its own
        planned = self._planned[index]
        if planned.emitted or key in planned.seen:
            return []
        planned.seen.add(key)
        return self._complete(planned)

    def _complete(self, planned: _Planned) -> list[ChunkPlan]:
        if len(planned.seen) < len(planned.chunk.files):
            return []
        planned.emitted = True
        self._packed.update(file.key for file in planned.chunk.files)
        return [planned.chunk]

    def _exclude(self, keys: Iterable[Hashable]) -> list[ChunkPlan]:
        """Take `keys` out of their planned chunks (their offsets close up); returns the
        chunks that are complete without them."""
        assert self._planned is not None
        gone: dict[int, set[Hashable]] = {}
        for key in keys:
            index = self._chunk_of.get(key)
            if index is not None:
                gone.setdefault(index, set()).add(key)
        done: list[ChunkPlan] = []
        for index, keys_gone in gone.items():
            planned = self._planned[index]
            if planned.emitted:
                continue
            kept: list[Placement] = []
            offset = 0
            for file in planned.chunk.files:
                if file.key not in keys_gone:
                    kept.append(Placement(file.key, offset, file.length))
                    offset += file.length
            planned.seen -= keys_gone
            if not kept:
                planned.emitted = True  # nothing of it is left to pack
                continue
            planned.chunk = ChunkPlan(tuple(kept), self._position_of[kept[0].key])
            done += self._complete(planned)
        return done
