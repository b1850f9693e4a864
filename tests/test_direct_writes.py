"""Large block files written past the page cache (direct_writes.py, durable.py): the
bytes on disk are exactly the header and the data whatever the buffer's alignment, a
filesystem that refuses direct I/O gets the same file through the page cache, and the
SSD tier reads both layouts of a block file back."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from bucketfs.cache import block_files, durable
from bucketfs.cache.block_files import MAGIC, PADDED
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.direct_writes import PAGE, address_of, write_direct
from bucketfs.cache.disk import DiskTier
from bucketfs.prefetch.eviction import make_policy

MiB = 1024 * 1024


def misaligned(length: int, offset: int) -> memoryview:
    """`length` random bytes starting `offset` bytes past a page boundary."""
    backing = bytearray(length + 2 * PAGE)
    start = -address_of(backing) % PAGE + offset
    view = memoryview(backing)[start:start + length]
    view[:] = os.urandom(length)
    return view


def head_for(data: memoryview, at_least: int) -> bytes:
    """A header of at least `at_least` bytes, padded to sit as direct I/O needs it."""
    return b"h" * (at_least + (address_of(data) - at_least) % PAGE)


@pytest.mark.parametrize("offset", [0, 16, 100, PAGE - 1])
@pytest.mark.parametrize("length", [PAGE, 3 * PAGE + 7, MiB + 1])
def test_write_direct_lays_out_header_and_data_exactly(tmp_path, offset, length):
    data = misaligned(length, offset)
    head = head_for(data, 40)
    path = tmp_path / "block"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        write_direct(fd, head, data)
    finally:
        os.close(fd)
    assert path.read_bytes() == head + bytes(data)


def test_write_direct_refuses_a_header_out_of_step_with_the_data(tmp_path):
    data = misaligned(MiB, 16)
    fd = os.open(tmp_path / "block", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        with pytest.raises(ValueError):
            write_direct(fd, head_for(data, 40) + b"x", data)
    finally:
        os.close(fd)


def written(monkeypatch) -> list[Path]:
    """The paths durable.write_many wrote past the page cache."""
    paths: list[Path] = []
    real = durable.write_direct

    def spy(fd, head, data):
        paths.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd, head, data)

    monkeypatch.setattr(durable, "write_direct", spy)
    return paths


def test_write_many_writes_direct_parts_past_the_page_cache(tmp_path, monkeypatch):
    direct = written(monkeypatch)
    data = misaligned(MiB + 5, 16)
    head = head_for(data, 30)
    target = tmp_path / "big"
    assert durable.write_many([(target, durable.Direct((head, data))),
                               (tmp_path / "small", [b"a", b"b"])]) == [None, None]
    assert target.read_bytes() == head + bytes(data)
    assert (tmp_path / "small").read_bytes() == b"ab"
    assert [p.name for p in direct] == [durable._temporary(target).name]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("refuses", ["open", "write"])
def test_a_filesystem_without_direct_io_gets_the_same_file(tmp_path, monkeypatch, refuses):
    real_open = os.open

    def no_direct_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def no_direct_write(fd, head, data):
        raise OSError(errno.EINVAL, "Invalid argument")

    if refuses == "open":
        monkeypatch.setattr(durable.os, "open", no_direct_open)
    else:
        monkeypatch.setattr(durable, "write_direct", no_direct_write)
    data = misaligned(MiB, 16)
    head = head_for(data, 30)
    target = tmp_path / "big"
    assert durable.write_many([(target, durable.Direct((head, data)))]) == [None]
    assert target.read_bytes() == head + bytes(data)
    assert not list(tmp_path.glob("*.tmp"))


def test_another_error_of_a_direct_write_fails_that_file_alone(tmp_path, monkeypatch):
    def broken(fd, head, data):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(durable, "write_direct", broken)
    data = misaligned(MiB, 16)
    outcomes = durable.write_many([(tmp_path / "big", durable.Direct((head_for(data, 30), data))),
                                   (tmp_path / "small", [b"x"])])
    assert isinstance(outcomes[0], OSError) and outcomes[0].errno == errno.EIO
    assert outcomes[1] is None and not (tmp_path / "big").exists()
    assert not list(tmp_path.glob("*.tmp"))


def tier(directory: Path) -> DiskTier:
    return DiskTier(directory, 64 * MiB, make_policy("cost-lrfu"), source="mem://b",
                    block_size=4 * MiB)


def large_blocks(count: int) -> list[tuple[BlockId, bytes, float]]:
    size = 2 * MiB + 123
    return [(BlockId(f"large{i}", "v1", 0, size=size), os.urandom(size), 0.01)
            for i in range(count)]


def test_large_blocks_are_written_direct_and_read_back_exactly(tmp_path, monkeypatch):
    direct = written(monkeypatch)
    disk = tier(tmp_path / "cache")
    batch = large_blocks(3)
    assert disk.put_many(batch) == 3
    assert len(direct) == 3
    for block, data, _ in batch:
        path = disk.block_path(disk._entry(block))
        assert path.read_bytes()[:len(PADDED)] == PADDED
        hit = disk.get(block)
        assert hit is not None and bytes(hit.data) == data
    disk.close()
    reopened = tier(tmp_path / "cache")
    for block, data, _ in batch:
        hit = reopened.get(block)
        assert hit is not None and bytes(hit.data) == data
    reopened.close()


def test_a_damaged_padded_block_file_is_a_miss(tmp_path):
    disk = tier(tmp_path / "cache")
    (block, data, cost), = large_blocks(1)
    assert disk.put_many([(block, data, cost)]) == 1
    path = disk.block_path(disk._entry(block))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert disk.get(block) is None and not path.exists()
    disk.close()


def test_a_large_block_file_of_the_unpadded_layout_still_reads(tmp_path, monkeypatch):
    """Block files written before the padded layout keep serving after an upgrade."""
    def unpadded(entry, data, crc):
        return (MAGIC + block_files._HEADER.pack(len(entry), len(data), crc) + entry, data)

    monkeypatch.setattr(block_files, "block_file", unpadded)
    disk = tier(tmp_path / "cache")
    (block, data, cost), = large_blocks(1)
    assert disk.put_many([(block, data, cost)]) == 1
    disk.close()
    monkeypatch.undo()
    reopened = tier(tmp_path / "cache")
    path = reopened.block_path(reopened._entry(block))
    assert path.read_bytes()[:len(MAGIC)] == MAGIC
    hit = reopened.get(block)
    assert hit is not None and bytes(hit.data) == data
    reopened.close()
