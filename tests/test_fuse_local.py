"""A real FUSE mount of a file:// bucket: tree, bytes, concurrency, EROFS, memory."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import random
import stat
from pathlib import Path

import pytest

from tests.mounting import daemon_pid, mounted, sha256_file, tree

pytestmark = pytest.mark.fuse

MiB = 1024**2


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bucket")
    rng = random.Random(7)
    files = {
        "train/cat/1.jpg": rng.randbytes(110_000),
        "train/cat/2.jpg": rng.randbytes(95_000),
        "train/dog/ünïcødé 100%+.jpg": rng.randbytes(130_000),
        "train/dog/zero.bin": b"",
        "val/x/y/z/deep.txt": b"deep\n",
        "big/three-mib.bin": rng.randbytes(3 * MiB + 17),
        "big/twenty-mib.bin": rng.randbytes(20 * MiB + 1),
        "with space/and+plus/file %41.txt": b"encoded-looking name\n",
    }
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "empty-dir").mkdir()
    return root


@pytest.fixture(scope="module")
def mount(source, tmp_path_factory):
    with mounted(f"file://{source}", tmp_path_factory.mktemp("m") / "mnt") as mnt:
        yield mnt


def test_tree_bytes_sizes_and_modes(source, mount):
    assert tree(mount) == tree(source)
    for dirpath, dirnames, filenames in os.walk(source):
        rel = os.path.relpath(dirpath, source)
        for name in filenames:
            st = os.stat(mount / rel / name)
            assert st.st_size == os.stat(os.path.join(dirpath, name)).st_size
            assert stat.S_IMODE(st.st_mode) == 0o444 and stat.S_ISREG(st.st_mode)
            assert st.st_uid == os.getuid()
        for name in dirnames:
            st = os.stat(mount / rel / name)
            assert stat.S_IMODE(st.st_mode) == 0o555 and stat.S_ISDIR(st.st_mode)
    assert os.statvfs(mount).f_namemax == 255


def test_missing_names(mount):
    assert not (mount / "nope").exists()
    assert not (mount / "nope").exists()  # answered from the kernel's negative cache
    with pytest.raises(NotADirectoryError):
        os.listdir(mount / "train/cat/1.jpg")


def test_random_pread_and_reads_past_eof(source, mount):
    rng = random.Random(3)
    for name in ("big/twenty-mib.bin", "big/three-mib.bin", "train/cat/1.jpg"):
        expected = (source / name).read_bytes()
        fd = os.open(mount / name, os.O_RDONLY)
        try:
            for _ in range(150):
                offset = rng.randrange(0, len(expected) + 4096)
                length = rng.choice([1, 100, 4096, 65536, 131072, 1 * MiB, 5 * MiB])
                assert os.pread(fd, length, offset) == expected[offset:offset + length]
            assert os.pread(fd, 10, len(expected)) == b""
            assert os.pread(fd, 10, len(expected) + 12345) == b""
        finally:
            os.close(fd)


def _hash_all(args: tuple[str, list[str], int]) -> dict[str, str]:
    root, names, seed = args
    random.Random(seed).shuffle(names)
    return {name: sha256_file(os.path.join(root, name)) for name in names}


def test_concurrent_readers_in_several_processes(source, mount):
    names = [k for k, v in tree(source).items() if v != "dir"]
    expected = {name: sha256_file(source / name) for name in names}
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.map(_hash_all, [(str(mount), list(names), seed) for seed in range(4)])
    for result in results:
        assert result == expected


@pytest.mark.parametrize(
    "operation",
    [
        lambda m: os.open(m / "train/cat/1.jpg", os.O_RDWR),
        lambda m: os.open(m / "train/cat/new.jpg", os.O_WRONLY | os.O_CREAT),
        lambda m: os.open(m / "train/cat/1.jpg", os.O_WRONLY | os.O_TRUNC),
        lambda m: os.mkdir(m / "newdir"),
        lambda m: os.unlink(m / "train/cat/1.jpg"),
        lambda m: os.rmdir(m / "empty-dir"),
        lambda m: os.rename(m / "train/cat/1.jpg", m / "train/cat/3.jpg"),
        lambda m: os.symlink("x", m / "link"),
        lambda m: os.chmod(m / "train/cat/1.jpg", 0o777),
        lambda m: os.utime(m / "train/cat/1.jpg"),
        lambda m: os.truncate(m / "train/cat/1.jpg", 0),
        lambda m: os.setxattr(m / "train/cat/1.jpg", "user.x", b"1"),
    ],
)
def test_every_modification_is_erofs(mount, operation):
    with pytest.raises(OSError) as info:
        operation(mount)
    assert info.value.errno == errno.EROFS


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_multi_gigabyte_object_streams_in_bounded_memory(tmp_path):
    """A 3 GiB object (sparse, with random data at a few places) read end to end: with a
    64 MiB RAM cache and read-ahead budget, the daemon's peak RSS stays far below it."""
    root = tmp_path / "bucket"
    root.mkdir()
    size = 3 * 1024**3 + 12345
    rng = random.Random(1)
    with open(root / "huge.bin", "wb") as f:
        f.truncate(size)
        for offset in (0, 1024**3 - 5, 2 * 1024**3 + 7, size - 4 * MiB):
            f.seek(offset)
            f.write(rng.randbytes(4 * MiB))
    expected = sha256_file(root / "huge.bin")
    with mounted(f"file://{root}", tmp_path / "mnt", "--readahead-budget", "64MiB",
                 "--readahead-max", "32MiB", "--ram-cache", "64MiB") as mnt:
        pid = daemon_pid(mnt.resolve())
        digest = hashlib.sha256()
        with open(mnt / "huge.bin", "rb", buffering=0) as f:
            while chunk := f.read(4 * MiB):
                digest.update(chunk)
        assert digest.hexdigest() == expected
        assert _peak_rss_kib(pid) < 400 * 1024


@pytest.mark.root  # only root may raise it
def test_kernel_readahead_is_raised_for_the_mount(source, tmp_path):
    from bucketfs.runtime import mounted as mount_entry

    with mounted(f"file://{source}", tmp_path / "mnt", "--kernel-readahead", "2MiB") as mnt:
        os.statvfs(mnt)
        device = mount_entry(str(mnt.resolve())).device
        value = int(Path(f"/sys/class/bdi/{device}/read_ahead_kb").read_text())
        # Only root may change it; anyone else keeps the kernel's 128 KiB.
        assert value == (2048 if os.geteuid() == 0 else 128)


def test_a_large_directory_lists_whole_over_many_readdir_calls(tmp_path):
    root = tmp_path / "bucket"
    (root / "many").mkdir(parents=True)
    # Names of varied length and prefixes of each other: resuming after "a1" must not
    # skip "a10".
    names = {f"a{i}" for i in range(3000)} | {"ü" * 40, "b", "b b"}
    for name in names:
        (root / "many" / name).write_bytes(name.encode())
    with mounted(f"file://{root}", tmp_path / "mnt") as mnt:
        listed = os.listdir(mnt / "many")
        assert sorted(listed) == sorted(names) and len(listed) == len(names)
        with os.scandir(mnt / "many") as entries:
            sizes = {e.name: e.stat().st_size for e in entries}
        assert sizes == {name: len(name.encode()) for name in names}
        assert (mnt / "many" / "a10").read_bytes() == b"a10"
        assert os.statvfs(mnt).f_files >= len(names)
