"""What the SSD tier's chunks need of its budget: the room a write asks for, what it
decides under the lock, and the tier's side of it (`SsdSpace`, which disk.py's
`DiskTier` is). Here so that chunks.py imports nothing of disk.py."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from rocksdict import Rdict

from bucketfs.cache.blocks import BlockId
from bucketfs.cache.ranking import IndexRanking
from bucketfs.cache.references import DeferredReferences


class Reservation(NamedTuple):
    """Room asked of the SSD tier's budget for one write."""

    #: What is being written (an entry's name, a chunk's rank name) and its file.
    name: bytes
    path: Path
    #: Bytes it will count in the budget, and how many of them need new room (a chunk
    #: of files already stored as blocks gives their room back when it is indexed; a
    #: write whose room was made member by member asks for none).
    size: int
    room: int
    #: The object keys coming in (hinted eviction weighs them against its victims).
    incoming: Sequence[str]


#: What a write decides under the lock: a Reservation, or True (nothing to write: it is
#: there already) or False (not stored).
Decision = Reservation | bool

#: Room made for each member of a chunk in turn, under the lock (hinted eviction, which
#: weighs each member's next use): (entry, length) pairs in, one verdict each out.
Admit = Callable[[list[tuple[bytes, int]]], list[bool]]


class SsdSpace(Protocol):
    """What ChunkStore needs of the SSD tier (disk.py's DiskTier)."""

    index: Rdict
    lock: threading.Lock
    ranking: IndexRanking
    references: DeferredReferences
    capacity: int
    writable: bool

    def store(self, decide: Callable[[], Decision], write: Callable[[Reservation], None],
              index: Callable[[Reservation], int]) -> bool: ...

    def count_used(self, size: int) -> None: ...

    def step_aside(self, exc: Exception) -> None: ...

    def block_of(self, entry: bytes) -> BlockId | None: ...

    def block_path(self, entry: bytes) -> Path: ...
