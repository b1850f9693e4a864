"""Large blocks' memory used again (bucketfs.spare_buffers): a buffer is handed to a new
GET only once nothing refers to the block it held, so no reader ever sees its bytes
change; through libcurl's GETs (the test server of test_curl_gets) and the RAM tier."""

from __future__ import annotations

import mmap
import random
import re
import sys
import threading
from pathlib import Path

import pytest
import trio

from bucketfs import huge_buffers
from bucketfs.cache import file_reads
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.direct_writes import private_pages
from bucketfs.cache.ram import RamTier
from bucketfs.prefetch.eviction import make_policy
from bucketfs.spare_buffers import (
    MIN_SIZE,
    GetBuffer,
    SpareBuffers,
    held_bytes,
    size_class,
    spare_buffers,
)
from tests.test_curl_gets import BODY, VERSION, gets, server  # noqa: F401 (fixture)

SIZE = 2 * MIN_SIZE


def block_of(fill: int, size: int = SIZE) -> memoryview:
    """A block as a GET hands it out: a read-only view of the start of a GET's buffer,
    as long as the size's class."""
    buffer = private_pages(size_class(size), kind=GetBuffer)
    buffer.write(bytes([fill]) * size)
    return memoryview(buffer)[:size].toreadonly()


def pool_taking(*sizes: int, limit: int = 64 * MIN_SIZE) -> SpareBuffers:
    """A pool whose GETs took buffers of these sizes (it keeps no other size)."""
    pool = SpareBuffers(limit)
    for size in sizes:
        pool.take(size)
    pool.fresh = 0
    return pool


def test_a_buffer_is_taken_again_only_when_nothing_refers_to_it() -> None:
    pool = pool_taking(SIZE)
    block = block_of(1)
    reply = block[100:200]  # a reply still on its way, a view of the same buffer
    buffer = id(block.obj)  # its id: a reference would keep it from being taken
    pool.offer(block)
    del block
    assert id(pool.take(SIZE)) != buffer
    assert bytes(reply) == b"\x01" * 100
    del reply
    assert id(pool.take(SIZE)) == buffer
    assert pool.reused == 1 and pool.fresh == 1


def test_buffers_holding_the_same_bytes_are_told_apart() -> None:
    """Two spare blocks of zeros (a sparse file's): the idle one is taken, and the one
    still read stays spare until its reader is done."""
    pool = pool_taking(SIZE)
    held, idle = block_of(0), block_of(0)
    held_id, idle_id = id(held.obj), id(idle.obj)
    pool.offer(held)
    pool.offer(idle)
    del idle
    assert id(pool.take(SIZE)) == idle_id
    assert pool.spare_bytes == SIZE
    del held
    assert id(pool.take(SIZE)) == held_id


def test_a_buffer_held_by_another_thread_is_not_taken() -> None:
    pool = pool_taking(SIZE)
    block = block_of(2)
    buffer = id(block.obj)
    holding, done = threading.Event(), threading.Event()

    def writer(view: memoryview) -> None:  # as the SSD write-through holds its block
        holding.set()
        done.wait(10)

    thread = threading.Thread(target=writer, args=(block,))
    thread.start()
    holding.wait(10)
    pool.offer(block)
    del block
    assert id(pool.take(SIZE)) != buffer
    done.set()
    thread.join()
    assert id(pool.take(SIZE)) == buffer


def test_only_a_large_get_buffer_of_a_size_class_taken_is_kept_and_taken() -> None:
    pool = pool_taking(SIZE, MIN_SIZE // 2)
    pool.offer(block_of(8, SIZE + 2))  # no GET asks for this class: it would stay idle
    pool.offer(b"x" * SIZE)  # bytes: not ours to overwrite
    pool.offer(memoryview(bytearray(SIZE)))  # no mapping: a GET writes into one
    pool.offer(block_of(3, MIN_SIZE // 2))  # small: the heap reuses it anyway
    pool.offer(memoryview(private_pages(SIZE)))  # a mapping no GET made (an SSD read's)
    pool.offer(memoryview(private_pages(SIZE))[:SIZE - 1])  # part of one
    pool.offer(memoryview(memoryview(b"y" * SIZE)))  # a view of bytes
    assert pool.spare_bytes == 0
    pool.offer(block_of(4))
    assert pool.spare_bytes == SIZE
    pool.take(SIZE + 1)  # another size class
    assert pool.reused == 0 and pool.spare_bytes == SIZE
    assert len(pool.take(SIZE)) == SIZE and pool.reused == 1


def test_sizes_of_one_class_share_a_buffer_which_the_ram_tier_charges_whole() -> None:
    """Files of a few MiB each of its own size: a body of any size in a class gets a
    buffer another body of that class let go, and the RAM tier charges a block the
    buffer's whole length, so that its budget bounds the memory."""
    assert [size_class(n) for n in (SIZE, SIZE + 1, SIZE + SIZE // 8, SIZE + SIZE // 8 + 1)] \
        == [SIZE, SIZE + SIZE // 8, SIZE + SIZE // 8, SIZE + SIZE // 4]
    assert all(n <= size_class(n) <= n * 9 / 8 for n in range(MIN_SIZE, 9 * MIN_SIZE, 4093))
    pool = pool_taking(SIZE + 1)
    block = block_of(9, SIZE + 1000)
    buffer = id(block.obj)
    assert held_bytes(block) == size_class(SIZE + 1) and len(block) == SIZE + 1000
    ram = RamTier(10 * SIZE, make_policy("lru"))
    ram.put(BlockId("a", "v", 0, size=SIZE + 1000), block, 1.0)
    assert ram.used == size_class(SIZE + 1)
    ram.remove(BlockId("a", "v", 0, size=SIZE + 1000), offer=False)
    assert ram.used == 0
    pool.offer(block)
    del block
    assert id(pool.take(SIZE + SIZE // 8)) == buffer and pool.reused == 1


def test_spares_are_bounded_in_bytes_and_go_when_idle() -> None:
    pool = pool_taking(SIZE, limit=3 * SIZE)
    blocks = [block_of(i) for i in range(5)]
    buffers = [id(block.obj) for block in blocks]
    for block in blocks:
        pool.offer(block)
    del block, blocks
    assert pool.spare_bytes == 3 * SIZE
    taken = [pool.take(SIZE) for _ in range(4)]
    assert [id(buffer) for buffer in taken[:3]] == buffers[2:]  # the oldest went
    assert pool.reused == 3 and pool.fresh == 1
    pool.offer(memoryview(taken[0]))
    pool.let_go_if_idle()  # there was activity since the last call: kept
    assert pool.spare_bytes == SIZE
    pool.let_go_if_idle()  # a whole period without any: dropped
    assert pool.spare_bytes == 0


def test_the_ram_tier_offers_what_it_evicts() -> None:
    spare_buffers.take(SIZE)  # a GET of this size: the pool keeps such buffers
    ram = RamTier(2 * SIZE, make_policy("lru"))
    first = block_of(5)
    buffer = id(first.obj)
    ram.put(BlockId("a", "v", 0, size=SIZE), first, 1.0)
    ram.put(BlockId("b", "v", 0, size=SIZE), block_of(6), 1.0)
    del first
    before = spare_buffers.reused
    ram.put(BlockId("c", "v", 0, size=SIZE), block_of(7), 1.0)  # evicts a
    assert id(spare_buffers.take(SIZE)) == buffer
    assert spare_buffers.reused == before + 1


@pytest.mark.parametrize("huge", [False, True])
def test_a_get_fills_a_spare_buffer_and_never_one_still_read(
        server, monkeypatch, huge) -> None:  # noqa: F811
    """A large GET's body lands in the buffer of a block let go, and a block someone
    still reads keeps its bytes while later GETs run; in a private mapping, or in a
    mapping of huge pages (huge_buffers.py, on from MIN_SIZE here so that the test server's
    body takes that path)."""
    if huge:
        monkeypatch.setattr(huge_buffers.settings, "enabled", True)
        monkeypatch.setattr(huge_buffers, "HUGE_PAGE", MIN_SIZE)
    endpoint, _ = server
    client = gets(endpoint)
    length = MIN_SIZE + 5

    async def main() -> None:
        spare_buffers.let_go_if_idle()
        spare_buffers.let_go_if_idle()  # start with none
        first = await client.get_range("obj", VERSION, 0, length)
        assert type(first.obj) is GetBuffer and first.readonly
        still_read = await client.get_range("obj", VERSION, 7, length)
        kept = bytes(still_read)
        spare_buffers.offer(first)
        spare_buffers.offer(still_read)
        reused_buffer = id(first.obj)
        del first
        before = spare_buffers.reused
        again = await client.get_range("obj", VERSION, 3, length)
        assert id(again.obj) == reused_buffer and spare_buffers.reused == before + 1
        assert bytes(again) == BODY[3:3 + length]
        third = await client.get_range("obj", VERSION, 11, length)
        assert third.obj is not still_read.obj
        assert bytes(still_read) == kept == BODY[7:7 + length]
        assert bytes(third) == BODY[11:11 + length]

    trio.run(main)
    client.close()


def test_a_finished_large_get_leaves_nothing_holding_its_buffer(server) -> None:  # noqa: F811
    """The handle kept for the next GET lets go of the body's mapping (it wrote into it
    with the mapping's own `write`): held, that memory would outlive the block the RAM
    tier let go, and the spare buffers would never find it idle to take."""
    endpoint, _ = server
    client = gets(endpoint)

    async def main() -> None:
        body = await client.get_range("obj", VERSION, 0, MIN_SIZE + 9)
        buffer = body.obj
        del body
        held = sys.getrefcount(buffer)
        client.close()  # the handles go: whatever they held of it goes with them
        assert sys.getrefcount(buffer) == held

    trio.run(main)


def _resident_bytes() -> int:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"^Rss:\s+(\d+) kB", rollup, re.MULTILINE)[1]) * 1024


def test_a_fresh_buffer_is_faulted_in_when_it_is_mapped(monkeypatch) -> None:
    """With no spare to take, a GET's buffer is a private mapping whose pages the kernel
    faulted in at once (MAP_POPULATE; one trap per page cost more), not a bytearray
    zeroed page by page, nor a mapping left to fault as the body arrives."""
    monkeypatch.setattr(huge_buffers.settings, "enabled", False)
    pool = SpareBuffers()
    size = 64 * MIN_SIZE
    before = _resident_bytes()
    buffer = pool.take(size)
    grew = _resident_bytes() - before
    assert type(buffer) is GetBuffer and len(buffer) == size and pool.fresh == 1
    assert grew >= size * 0.9, f"only {grew} of {size} bytes resident"
    buffer[size - 1:] = b"x"  # writable, as a GET fills it


def test_a_huge_page_buffer_is_kept_and_taken_again_only_when_idle(monkeypatch) -> None:
    monkeypatch.setattr(huge_buffers.settings, "enabled", True)
    pool = pool_taking(SIZE)
    buffer = pool.take(SIZE)
    assert type(buffer) is GetBuffer and len(buffer) == SIZE
    block = memoryview(buffer).toreadonly()
    del buffer
    reply = block[10:20]
    pool.offer(block)
    del block
    assert pool.spare_bytes == SIZE
    assert pool.take(SIZE) is not reply.obj
    spare = id(reply.obj)
    del reply
    assert id(pool.take(SIZE)) == spare


@pytest.mark.parametrize("huge", [False, True])
def test_a_block_read_from_ssd_lands_in_the_mapping_of_one_let_go_never_one_still_read(
        tmp_path, monkeypatch, huge) -> None:
    """A large block file read whole (file_reads.py, O_DIRECT) goes into the mapping of a
    block read so before and let go, once nothing refers to it; a block someone still
    reads keeps its bytes while later reads run. The data is a view past the file's
    header page, as the SSD tier hands it out, so the view is not the whole mapping."""
    if huge:
        monkeypatch.setattr(huge_buffers.settings, "enabled", True)
        monkeypatch.setattr(huge_buffers, "HUGE_PAGE", MIN_SIZE)
    pool = SpareBuffers(64 * MIN_SIZE)
    monkeypatch.setattr(file_reads, "spare_buffers", pool)
    page = mmap.PAGESIZE
    contents = [random.Random(i).randbytes(page + SIZE) for i in range(4)]
    paths = []
    for i, content in enumerate(contents):
        paths.append(tmp_path / f"block{i}")
        paths[-1].write_bytes(content)
    first = file_reads.read_whole(paths[0])
    # Read direct, into a mapping of its own: in ordinary pages one the RAM tier charges
    # whole (held_bytes); in huge pages a plain one reaching 2 MiB past the block.
    assert type(first.obj) is (mmap.mmap if huge else huge_buffers.ReadMapping)
    data, still_read = first[page:], file_reads.read_whole(paths[1])[page:]
    kept = bytes(still_read)
    pool.offer(data)  # as the RAM tier offers what it lets go
    pool.offer(still_read)
    assert pool.reads.spare_bytes == 2 * len(first.obj)
    mapping = id(first.obj)
    del first, data
    again = file_reads.read_whole(paths[2])
    assert id(again.obj) == mapping and pool.reads.reused == 1
    assert bytes(again) == contents[2]
    third = file_reads.read_whole(paths[3])
    assert third.obj is not still_read.obj and pool.reads.fresh == 3
    assert bytes(still_read) == kept == contents[1][page:]
    assert bytes(third) == contents[3]
    # Idle for a period: the spare mappings go.
    pool.let_go_if_idle()
    pool.let_go_if_idle()
    assert pool.reads.spare_bytes == 0


def test_ssd_reads_of_sizes_in_one_class_share_a_mapping_charged_whole(
        tmp_path, monkeypatch) -> None:
    """Block files of a few MiB, each of its own size: a read lands in the mapping of
    an earlier read of another size in the same size class, once that block is let go,
    and the RAM tier charges such a block its whole mapping (header page and the class's
    slack with it), so that its budget bounds the memory."""
    monkeypatch.setattr(huge_buffers.settings, "enabled", False)
    pool = SpareBuffers(64 * MIN_SIZE)
    monkeypatch.setattr(file_reads, "spare_buffers", pool)
    page = mmap.PAGESIZE
    sizes = [SIZE + 10_000, SIZE + 70_000]  # one class: 2 MiB + 256 KiB
    assert size_class(page + sizes[0]) == size_class(page + sizes[1]) > page + sizes[1]
    contents = [random.Random(i).randbytes(page + n) for i, n in enumerate(sizes)]
    for i, content in enumerate(contents):
        (tmp_path / f"block{i}").write_bytes(content)
    first = file_reads.read_whole(tmp_path / "block0")
    data = first[page:]
    assert held_bytes(data) == len(first.obj) == size_class(page + sizes[0])
    ram = RamTier(10 * SIZE, make_policy("lru"))
    ram.put(BlockId("a", "v", 0, size=sizes[0]), data, 1.0)
    assert ram.used == len(first.obj)
    del first, data
    ram.remove(BlockId("a", "v", 0, size=sizes[0]), offer=False)
    assert ram.used == 0
    second = file_reads.read_whole(tmp_path / "block1")
    assert (pool.reads.reused, pool.reads.fresh) == (0, 2)  # never offered: not taken
    # Offered as the RAM tier offers what it lets go, once no one reads it: taken.
    pool.offer(second[page:])
    taken = id(second.obj)
    del second
    again = file_reads.read_whole(tmp_path / "block0")
    assert id(again.obj) == taken and pool.reads.reused == 1
    assert bytes(again) == contents[0]
