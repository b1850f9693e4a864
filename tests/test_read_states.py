"""With kernel_opens the daemon keeps a read state per inode (an LRU), made at a file's
first read. When the RAM tier cannot hold a block, each state may keep its last block
(up to a block's bytes), so the LRU is cut to 64 states: memory stays bounded however
many files the kernel keeps open."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from bucketfs.cache.blocks import ObjectRef
from bucketfs.cache.schema import DirEntry
from bucketfs.fs import _LOOKED_UP, _READ_STATES_WITH_BLOCKS, READ_STATES, Operations
from bucketfs.reader import OpenFile, ReadSettings

BLOCK = 4 * 1024**2


@dataclass
class Cache:
    ram_capacity: int

    def keeps_in_ram(self, size: int) -> bool:
        return size <= self.ram_capacity


class Reader:
    block_size = BLOCK

    def __init__(self, ram_capacity: int) -> None:
        self.cache = Cache(ram_capacity)
        self.opened: list[str] = []

    def open(self, key: str, version: str, size: int) -> OpenFile:
        self.opened.append(key)
        return OpenFile(ObjectRef(key, version, size), ReadSettings())


class Namespace:
    def get(self, inode: int) -> DirEntry:
        return DirEntry(name=f"f{inode}", is_dir=False, key=f"k/{inode}", size=10 * BLOCK,
                        version="v1", inode=inode)


def operations(ram_capacity: int) -> Operations:
    return Operations(Namespace(), Reader(ram_capacity), uid=0, gid=0,  # type: ignore[arg-type]
                      kernel_ttl=1.0)


def test_a_ram_tier_smaller_than_a_block_keeps_64_states_the_latest_used():
    ops = operations(ram_capacity=BLOCK // 2)
    assert ops.read_states_limit == _READ_STATES_WITH_BLOCKS == 64
    for inode in range(2, 202):
        ops._read_state(inode, 0)
        ops._read_state(2, BLOCK)  # inode 2 is read on and on: never the oldest
    assert len(ops.read_states) == 64
    assert 2 in ops.read_states
    assert set(ops.read_states) == {2, *range(139, 202)}


def test_a_read_within_a_file_keeps_its_state_and_a_read_at_its_start_renews_it():
    ops = operations(ram_capacity=BLOCK // 2)
    first = ops._read_state(7, 0)
    assert ops._read_state(7, 3 * BLOCK) is first
    assert ops._read_state(7, 0) is not first  # a reader that starts the file again
    assert ops.reader.opened == ["k/7", "k/7"]  # type: ignore[attr-defined]


def test_a_ram_tier_that_holds_blocks_keeps_4096_states():
    ops = operations(ram_capacity=64 * BLOCK)
    assert ops.read_states_limit == READ_STATES == 4096
    for inode in range(2, 5000):
        ops._read_state(inode, 0)
    assert len(ops.read_states) == 4096


class CountingNamespace(Namespace):
    """Counts index reads (`get`); `lookup` finds every name, as the index would."""

    def __init__(self) -> None:
        self.gets = 0
        self.forgotten: list[int] = []

    def get(self, inode: int) -> DirEntry:
        self.gets += 1
        return super().get(inode)

    async def lookup(self, parent: int, name: str) -> DirEntry:
        return super().get(int(name.removeprefix("f")))

    def forget(self, inode: int) -> None:
        self.forgotten.append(inode)


def counting_operations() -> tuple[Operations, CountingNamespace]:
    namespace = CountingNamespace()
    ops = Operations(namespace, Reader(64 * BLOCK), uid=0, gid=0,  # type: ignore[arg-type]
                     kernel_ttl=1.0)
    return ops, namespace


def test_the_read_after_a_lookup_takes_the_entry_the_lookup_found():
    ops, namespace = counting_operations()
    attrs = trio.run(ops.lookup, 1, b"f7", None)
    assert attrs.st_ino == 7
    node, _ = ops._read_state(7, 0)
    assert (node.key, namespace.gets) == ("k/7", 0)  # not read from the index
    assert ops.looked_up == {}  # taken by the first read: the read state holds it now
    ops.read_states.clear()
    node, _ = ops._read_state(7, 0)  # its read state dropped: the index again
    assert (node.key, namespace.gets) == ("k/7", 1)


def test_looked_up_entries_are_bounded_and_forgotten_with_their_inode():
    ops, namespace = counting_operations()
    for inode in range(2, 2 + _LOOKED_UP + 10):
        trio.run(ops.lookup, 1, f"f{inode}".encode(), None)
    assert len(ops.looked_up) == _LOOKED_UP
    assert 2 not in ops.looked_up and 12 in ops.looked_up  # the oldest went first
    trio.run(ops.forget, [(12, 1)])
    assert 12 not in ops.looked_up and namespace.forgotten == [12]
    ops._read_state(12, 0)
    assert namespace.gets == 1
