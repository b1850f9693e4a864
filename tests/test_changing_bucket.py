"""A bucket that changes under a mount (docs/CONSISTENCY.md), on SeaweedFS (S3) and
fake-gcs-server (GCS).

What bucketfs promises: an open handle reads the version it opened, or fails with EIO;
never a mix of versions, never a silently shorter file. A new open sees the new version
once the listing is older than `--metadata-ttl` (and the kernel's `--kernel-ttl` has
run out); with the default TTL (forever) the listing is kept, across remounts too, until
a read finds the version gone or `bucketfs mount --refresh`.

Reads here go through the page cache, as an application's do; between reads the page
cache is dropped where a read must reach the daemon. Objects are cut into 256 KiB blocks
so that a read of the old version spans blocks fetched before and after the change.
A changed object gets a new inode, so the kernel never shares its size or its cached
pages between handles pinned to different versions (these cases failed before that).
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.mounting import drop_page_cache, mounted, read_log
from tests.servers import GcsServer, S3Server

pytestmark = [pytest.mark.fuse, pytest.mark.root]  # root: drops the page cache

KiB, MiB = 1024, 1024**2
SIZE = 4 * MiB
CHUNK = 128 * KiB
OLD = random.Random("old").randbytes(SIZE)
#: Long enough for the largest new version; each case takes the size it needs.
NEW = random.Random("new").randbytes(SIZE + 4 * KiB)
BLOCKS = ("--block-size", "256KiB", "--readahead-max", "256KiB")
TTL_1 = ("--metadata-ttl", "1", "--kernel-ttl", "1")
#: How long a change may take to show once the TTL has run out (a listing, a getattr).
SHOW_S = 10.0
_buckets = itertools.count()

class WrongBytes(AssertionError):
    """A handle returned bytes of a version it was not opened on, or EOF before the end
    of its version."""


def one_version(results: list[str], allowed: frozenset[str] = frozenset({"old", "EIO"}),
                ) -> None:
    if not set(results) <= allowed:
        raise WrongBytes(f"chunks read: {squeeze(results)}")


@dataclass
class Remote:
    server: S3Server | GcsServer
    scheme: str
    bucket: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}"

    @property
    def args(self) -> tuple[str, ...]:
        return ("--addressing-style", "path") if self.scheme == "s3" else ()

    def put(self, data: bytes, key: str = "f.bin") -> None:
        self.server.put(self.bucket, key, data)

    def delete(self, key: str = "f.bin") -> None:
        self.server.delete(self.bucket, key)

    def mount(self, mountpoint: Path, *args: str):  # type: ignore[no-untyped-def]
        return mounted(self.url, mountpoint, *self.args, *BLOCKS, *args,
                       env=self.server.env())


@pytest.fixture(params=["s3", "gs"])
def remote(request: pytest.FixtureRequest) -> Iterator[Remote]:
    """A fresh bucket holding f.bin = OLD (and keep.bin, which never changes)."""
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    bucket = f"changing-{request.param}-{next(_buckets)}"
    server.create_bucket(bucket)
    remote = Remote(server, request.param, bucket)
    remote.put(OLD)
    remote.put(b"unchanged\n", "keep.bin")
    yield remote


def what(offset: int, data: bytes, new: bytes) -> str:
    """Which version `data`, read at `offset`, belongs to."""
    if not data:
        return "EOF"
    if data == OLD[offset:offset + len(data)]:
        return "old"
    if data == new[offset:offset + len(data)]:
        return "new"
    return "neither"


def read_chunk(fd: int, offset: int, new: bytes) -> str:
    try:
        return what(offset, os.pread(fd, CHUNK, offset), new)
    except OSError as exc:
        return errno.errorcode[exc.errno]


def squeeze(results: list[str]) -> list[tuple[str, int]]:
    """["old", "old", "EIO"] -> [("old", 2), ("EIO", 1)]: short failure messages."""
    return [(name, len(list(group))) for name, group in itertools.groupby(results)]


def wait_until(condition: Callable[[], bool], what: str) -> float:
    """Poll until `condition()`; the seconds it took. Fails after SHOW_S."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < SHOW_S, f"{what}: not within {SHOW_S} s"
        time.sleep(0.05)
    return time.monotonic() - started


def size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


# --- An open handle: one version, or EIO ------------------------------------------------


@pytest.mark.parametrize("new_size", [
    SIZE,
    SIZE + 4 * KiB,
    SIZE // 4,
], ids=["same-size", "larger", "smaller"])
def test_open_handle_reads_the_old_version_or_eio_after_an_overwrite(
        remote: Remote, tmp_path: Path, new_size: int) -> None:
    """Overwrite mid-read; every later chunk of the handle, each read after dropping the
    page cache, is the old version's or EIO, up to the old version's size."""
    new = NEW[:new_size]
    with remote.mount(tmp_path / "mnt") as mnt:
        fd = os.open(mnt / "f.bin", os.O_RDONLY)
        try:
            results = [read_chunk(fd, 0, new)]
            remote.put(new)
            for offset in range(CHUNK, SIZE, CHUNK):
                drop_page_cache()
                results.append(read_chunk(fd, offset, new))
        finally:
            os.close(fd)
        log = read_log(tmp_path / "mnt.log")
    assert results[0] == "old"
    one_version(results)
    # Some block was not cached when the object changed: the version check refused it.
    assert "EIO" in results and "changed in the bucket" in log, squeeze(results)


def test_open_handle_reads_the_old_version_or_eio_after_a_delete(
        remote: Remote, tmp_path: Path) -> None:
    with remote.mount(tmp_path / "mnt") as mnt:
        fd = os.open(mnt / "f.bin", os.O_RDONLY)
        try:
            results = [read_chunk(fd, 0, b"")]
            remote.delete()
            for offset in range(CHUNK, SIZE, CHUNK):
                drop_page_cache()
                results.append(read_chunk(fd, offset, b""))
        finally:
            os.close(fd)
    assert results[0] == "old"
    one_version(results)


def test_old_handle_never_reads_pages_a_newer_handle_cached(
        remote: Remote, tmp_path: Path) -> None:
    """A handle on the old version and one opened on the new version after the TTL:
    what the new one reads into the page cache is not served to the old one."""
    new = NEW[:SIZE + 4 * KiB]  # another size, so that stat shows when the mount knows
    with remote.mount(tmp_path / "mnt", *TTL_1) as mnt:
        path = mnt / "f.bin"
        fd = os.open(path, os.O_RDONLY)
        try:
            assert read_chunk(fd, 0, new) == "old"
            remote.put(new)
            wait_until(lambda: size_of(path) == len(new), "the new size")
            assert path.read_bytes() == new  # a new open: the new version, whole
            results = [read_chunk(fd, offset, new) for offset in range(CHUNK, SIZE, CHUNK)]
        finally:
            os.close(fd)
    one_version(results)


def test_new_handle_never_reads_pages_an_old_handle_cached(
        remote: Remote, tmp_path: Path) -> None:
    """The other way round: the old handle rereads after the new open, from blocks of
    the old version still in the daemon's RAM; the new handle must not see them."""
    new = NEW[:SIZE + 4 * KiB]
    with remote.mount(tmp_path / "mnt", *TTL_1) as mnt:
        path = mnt / "f.bin"
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, SIZE, 0) == OLD  # every block of the old version in RAM
            remote.put(new)
            wait_until(lambda: size_of(path) == len(new), "the new size")
            with open(path, "rb") as f:
                # Opening drops the inode's pages; the old handle reads them in again.
                assert {read_chunk(fd, offset, new) for offset in range(0, SIZE, CHUNK)} \
                    <= {"old", "EIO"}
                data = f.read()
        finally:
            os.close(fd)
    one_version([what(o, data[o:o + CHUNK], new) for o in range(0, len(new), CHUNK)],
                frozenset({"new"}))


# --- New opens ----------------------------------------------------------------------------


def test_new_opens_see_an_overwrite_and_a_delete_after_the_ttl(
        remote: Remote, tmp_path: Path) -> None:
    """With --metadata-ttl 1 --kernel-ttl 1: a new open gets the new size and bytes, and
    a deleted object disappears, within the TTL and a listing; even with every block of
    the old version cached (RAM and kernel) before the change."""
    new = NEW[:SIZE + 4 * KiB]
    remote.put(OLD, "gone.bin")
    with remote.mount(tmp_path / "mnt", *TTL_1) as mnt:
        assert (mnt / "f.bin").read_bytes() == OLD
        assert (mnt / "gone.bin").read_bytes() == OLD
        remote.put(new)
        remote.delete("gone.bin")
        took = wait_until(lambda: size_of(mnt / "f.bin") == len(new), "the new size")
        assert (mnt / "f.bin").read_bytes() == new
        gone = wait_until(lambda: not (mnt / "gone.bin").exists(), "the delete")
        assert sorted(os.listdir(mnt)) == ["f.bin", "keep.bin"]
    print(f"new version seen after {took:.2f} s, delete after {gone:.2f} s more")


def test_default_ttl_keeps_the_listing_until_a_refresh(remote: Remote, tmp_path: Path) -> None:
    """With the default TTL (forever) and a cache directory: after an overwrite and a
    delete, the mount, and a remount, go on showing the old listing and serving the old
    version from the cache (no read reaches the bucket to find it gone); a remount with
    --refresh shows the bucket as it is. Old entries on SSD are named by their version,
    so they are never served for the new one."""
    cache = ("--cache-dir", str(tmp_path / "cache"))
    remote.put(OLD, "gone.bin")
    with remote.mount(tmp_path / "mnt", *cache) as mnt:
        assert (mnt / "f.bin").read_bytes() == OLD
        assert (mnt / "gone.bin").read_bytes() == OLD
        remote.put(NEW)
        remote.delete("gone.bin")
        drop_page_cache()
        assert (mnt / "f.bin").stat().st_size == SIZE
        assert (mnt / "f.bin").read_bytes() == OLD  # from the RAM tier: one version
        assert (mnt / "gone.bin").read_bytes() == OLD
    with remote.mount(tmp_path / "mnt", *cache) as mnt:
        assert sorted(os.listdir(mnt)) == ["f.bin", "gone.bin", "keep.bin"]
        assert (mnt / "f.bin").read_bytes() == OLD  # from the SSD tier
    with remote.mount(tmp_path / "mnt", *cache, "--refresh") as mnt:
        assert sorted(os.listdir(mnt)) == ["f.bin", "keep.bin"]
        assert (mnt / "f.bin").stat().st_size == len(NEW)
        assert (mnt / "f.bin").read_bytes() == NEW


def test_default_ttl_refreshes_a_file_whose_read_failed(remote: Remote, tmp_path: Path) -> None:
    """Without a TTL, a read that finds the version gone (EIO) makes the mount look the
    object up again: the next open reads the new version whole."""
    new = NEW[:SIZE + 4 * KiB]
    with remote.mount(tmp_path / "mnt") as mnt:
        fd = os.open(mnt / "f.bin", os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.pread(fd, CHUNK, 0) == OLD[:CHUNK]
            remote.put(new)
            with pytest.raises(OSError) as caught:
                os.pread(fd, CHUNK, SIZE - CHUNK)
            assert caught.value.errno == errno.EIO
        finally:
            os.close(fd)
        wait_until(lambda: size_of(mnt / "f.bin") == len(new), "the new size")
        assert (mnt / "f.bin").read_bytes() == new


def test_a_deleted_object_found_by_a_read_fails_new_opens(
        remote: Remote, tmp_path: Path) -> None:
    """Default TTL: once a read found the object deleted, a new open fails (ENOENT or
    EIO) rather than reading an empty file."""
    with remote.mount(tmp_path / "mnt") as mnt:
        fd = os.open(mnt / "f.bin", os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.pread(fd, CHUNK, 0) == OLD[:CHUNK]
            remote.delete()
            with pytest.raises(OSError) as caught:
                os.pread(fd, CHUNK, SIZE - CHUNK)
            assert caught.value.errno == errno.EIO
        finally:
            os.close(fd)
        wait_until(lambda: size_of(mnt / "f.bin") != SIZE, "the delete")
        try:
            data = (mnt / "f.bin").read_bytes()
        except OSError as exc:
            assert exc.errno in (errno.ENOENT, errno.EIO), exc
        else:
            raise WrongBytes(f"a deleted 4 MiB object read as {len(data)} bytes")
