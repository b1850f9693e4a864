"""Reading an SSD block file whole (bucketfs/cache/file_reads.py): the exact bytes at
every size around a page, past the page cache where the filesystem allows it, and
through it where the filesystem refuses direct I/O."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest

from bucketfs import huge_buffers
from bucketfs.cache import file_reads
from bucketfs.cache.direct_writes import address_of
from bucketfs.cache.durable import drop_cached, write_durably
from bucketfs.cache.file_reads import read_whole
from tests.pages import resident_bytes

PAGE = mmap.PAGESIZE
SIZES = [0, 1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17, (1 << 20) + 7, 4 << 20,
         PAGE + (4 << 20) + 100]


def written(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    write_durably(path, [data])
    return data


def drop_from_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        drop_cached(f.fileno())


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", SIZES)
def test_the_whole_file_comes_back_exact(tmp_path, size, direct):
    path = tmp_path / "block"
    data = written(path, size)
    assert read_whole(path, direct=direct) == data


def test_a_direct_read_leaves_nothing_in_the_page_cache(disk_path):
    path = disk_path / "block"
    data = written(path, (4 << 20) + 123)
    drop_from_page_cache(path)
    assert resident_bytes(path) == 0
    assert read_whole(path) == data
    assert resident_bytes(path) == 0
    # Through the page cache, the same read leaves the file there: what the check sees.
    assert read_whole(path, direct=False) == data
    assert resident_bytes(path) > 0


def test_a_filesystem_that_refuses_direct_opens_is_read_through_the_page_cache(
        tmp_path, monkeypatch):
    path = tmp_path / "block"
    data = written(path, 2 * PAGE + 5)
    real_open = os.open

    def refusing(file, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags, *args)

    monkeypatch.setattr(file_reads.os, "open", refusing)
    assert read_whole(path) == data


def test_a_filesystem_that_refuses_direct_reads_is_read_through_the_page_cache(
        tmp_path, monkeypatch):
    path = tmp_path / "block"
    data = written(path, 2 * PAGE + 5)

    def refusing(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(file_reads.os, "preadv", refusing)
    assert read_whole(path) == data


def test_other_errors_are_raised(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_whole(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        read_whole(tmp_path / "missing", direct=False)


def test_a_direct_read_lands_in_private_memory_not_shmem(tmp_path):
    """Python's mmap.mmap(-1, n) is shared memory, backed by shmem pages that cost more
    to fault in (file_reads.py, direct_writes.private_pages)."""
    path = tmp_path / "block"
    written(path, 4 << 20)
    block = read_whole(path, direct=True)
    address = address_of(block)
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        low, high = (int(part, 16) for part in span.split("-"))
        if low <= address < high:
            assert perms.endswith("p"), line  # private: not "s" (shared, /dev/zero)
            assert "/dev/zero" not in line
            return
    raise AssertionError("the buffer is in no mapping")


def test_a_large_block_files_data_lands_on_a_huge_page_boundary(tmp_path, monkeypatch):
    """A block file's data starts in its second page; read with huge pages on, it lies
    in whole 2 MiB pages (huge_buffers.read_from), which the direct read pins one each."""
    monkeypatch.setattr(huge_buffers.settings, "enabled", True)
    path = tmp_path / "block"
    data = written(path, PAGE + (4 << 20))
    block = read_whole(path, direct=True)
    assert block == data
    assert address_of(block[PAGE:]) % (2 << 20) == 0
