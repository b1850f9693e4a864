"""Writing cache files durably in batches (durable.py) and the SSD tier's batched
puts: every file either lands whole under its name or not at all, and a batch that
partly fails records what was written and gives back the room of the rest."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from bucketfs.cache import durable
from bucketfs.cache.blocks import BlockId
from bucketfs.cache.disk import DiskTier
from bucketfs.prefetch.eviction import make_policy

KiB = 1024
BLOCK = 64 * KiB


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.tmp"))


def test_write_many_writes_every_file_whole(tmp_path):
    files = [(tmp_path / f"f{i}", [b"head-", os.urandom(1000 + i)]) for i in range(20)]
    assert durable.write_many(files) == [None] * 20
    for path, parts in files:
        assert path.read_bytes() == b"".join(parts)
    assert leftovers(tmp_path) == []


def test_a_file_that_cannot_be_written_fails_alone(tmp_path):
    files = [(tmp_path / "a", [b"1"]), (tmp_path / "missing" / "b", [b"2"]),
             (tmp_path / "c", [b"3"])]
    outcomes = durable.write_many(files)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], FileNotFoundError)
    assert (tmp_path / "a").read_bytes() == b"1" and (tmp_path / "c").read_bytes() == b"3"
    assert leftovers(tmp_path) == []


def test_a_failed_flush_renames_nothing(tmp_path, monkeypatch):
    def no_flush(paths):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(durable, "_flush", no_flush)
    outcomes = durable.write_many([(tmp_path / "a", [b"1"]), (tmp_path / "b", [b"2"])])
    assert all(isinstance(o, OSError) and o.errno == errno.EIO for o in outcomes)
    assert list(tmp_path.iterdir()) == []  # neither the names nor the temporaries


def test_without_syncfs_each_file_is_fsynced(tmp_path, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(durable, "_syncfs", None)
    monkeypatch.setattr(durable.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    files = [(tmp_path / f"f{i}", [b"x" * i]) for i in range(5)]
    assert durable.write_many(files) == [None] * 5
    assert len(synced) == 5
    assert [p.read_bytes() for p, _ in files] == [b"x" * i for i in range(5)]


# These are the block files' batches (tests/test_write_through_chunks.py has the chunks).
pytestmark = pytest.mark.usefixtures("one_file_per_block")


def tier(directory: Path, capacity: int) -> DiskTier:
    return DiskTier(directory, capacity, make_policy("cost-lrfu"), source="mem://b",
                    block_size=BLOCK)


def blocks(count: int, size: int = 10 * KiB) -> list[tuple[BlockId, bytes, float]]:
    return [(BlockId(f"k{i}", "v1", 0, size=size), os.urandom(size), 0.01)
            for i in range(count)]


def test_put_many_stores_a_batch_and_counts_what_is_there_already(tmp_path):
    disk = tier(tmp_path / "cache", 10 * 1024 * KiB)
    batch = blocks(8)
    assert disk.put_many(batch[:3]) == 3
    assert disk.put_many(batch) == 8  # three were stored already
    assert disk.used == 8 * 10 * KiB and not disk.writing
    for block, data, _ in batch:
        hit = disk.get(block)
        assert hit is not None and hit.data == data
    disk.close()
    reopened = tier(tmp_path / "cache", 10 * 1024 * KiB)
    assert reopened.used == 8 * 10 * KiB
    assert all(reopened.holds(block) for block, _, _ in batch)
    reopened.close()


def test_put_many_keeps_the_budget_within_one_batch(tmp_path):
    disk = tier(tmp_path / "cache", 5 * 10 * KiB)
    batch = blocks(12)
    # Blocks of a batch being written are not yet in the eviction order: the first
    # five fill the budget, and the rest find no room.
    assert disk.put_many(batch) == 5
    assert disk.used == disk.capacity
    assert [disk.holds(block) for block, _, _ in batch] == [True] * 5 + [False] * 7
    # The next batch evicts what the first one stored.
    assert disk.put_many(batch[5:10]) == 5
    assert disk.used == disk.capacity and disk.evictions == 5
    disk.close()


def test_put_many_records_the_files_written_and_gives_back_the_rest(tmp_path, monkeypatch):
    disk = tier(tmp_path / "cache", 10 * 1024 * KiB)
    batch = blocks(4)
    real = durable.write_many

    def second_fails(files):
        outcomes = real(files)
        os.unlink(files[1][0])
        outcomes[1] = OSError(errno.EIO, "Input/output error")
        return outcomes

    monkeypatch.setattr("bucketfs.cache.disk.write_many", second_fails)
    assert disk.put_many(batch) == 3
    assert [disk.holds(block) for block, _, _ in batch] == [True, False, True, True]
    assert disk.used == 3 * 10 * KiB and not disk.writing
    assert not disk.writable  # EIO: the tier steps aside
    disk.close()


def test_put_many_refuses_bytes_of_the_wrong_length(tmp_path):
    disk = tier(tmp_path / "cache", 10 * 1024 * KiB)
    good, (block, data, cost) = blocks(2)
    with pytest.raises(ValueError):
        disk.put_many([good, (block, data + b"!", cost)])
    assert disk.used == 0 and not disk.writing and not disk.holds(good[0])
    disk.close()


def test_parts_are_written_in_order_in_one_call_each_iov_max(tmp_path, monkeypatch):
    # Each write releases the GIL, and a worker then waits to take it back: the parts of
    # a file go in one writev (as many as the kernel takes in one).
    calls: list[int] = []
    real = os.writev

    def counting(fd, buffers):
        calls.append(len(buffers))
        return real(fd, buffers)

    monkeypatch.setattr(durable.os, "writev", counting)
    parts = [os.urandom(100 + i) for i in range(40)] + [b"", os.urandom(300_000)]
    durable.write_durably(tmp_path / "chunk", parts)
    assert (tmp_path / "chunk").read_bytes() == b"".join(parts)
    assert calls == [41]  # the empty part is not sent
    calls.clear()
    many = [bytes([i % 251]) * 3 for i in range(2 * durable._IOV_MAX + 5)]
    assert durable.write_many([(tmp_path / "many", many)]) == [None]
    assert (tmp_path / "many").read_bytes() == b"".join(many)
    assert calls == [durable._IOV_MAX, durable._IOV_MAX, 5]


def test_a_short_write_goes_on_from_where_it_stopped(tmp_path, monkeypatch):
    real = os.writev

    def at_most_1000_bytes(fd, buffers):  # as a signal or a full pipe may cut one short
        joined = b"".join(bytes(b) for b in buffers)
        return real(fd, [joined[:1000]])

    monkeypatch.setattr(durable.os, "writev", at_most_1000_bytes)
    parts = [os.urandom(n) for n in (10, 999, 1, 2500, 7)]
    durable.write_durably(tmp_path / "cut", parts)
    assert (tmp_path / "cut").read_bytes() == b"".join(parts)
