"""The cache's device full, read-only, or removed while mounted, or unusable at mount:
reads go on from the bucket, byte for byte, with one warning each, never a traceback,
and the mount stays up. The device is a small ext4 filesystem on a loop device."""

from __future__ import annotations

import contextlib
import random
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.mounting import drop_page_cache, mounted, read_log, tree

pytestmark = [pytest.mark.fuse, pytest.mark.root]

KiB, MiB = 1024, 1024**2
# 24 MiB of files, more than the devices hold; directories listed only once it is full.
FILL = {f"fill/{i:03d}.bin": random.Random(i).randbytes(400 * KiB + i) for i in range(60)}
LATER = {f"later/d{i:02d}/f{j}.bin": random.Random(1000 + 10 * i + j).randbytes(9_000)
         for i in range(12) for j in range(3)}
FILES = {**FILL, **LATER}


@pytest.fixture(scope="module")
def bucket(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bucket")
    for key, data in FILES.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@pytest.fixture
def small_tmpfs(tmp_path) -> Path:
    """A 6 MiB filesystem of its own (tmpfs: RocksDB cannot write ahead into space it
    set aside, as it can on ext4, so a full device refuses the index's writes too)."""
    path = tmp_path / "tmpfs"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m,mode=0700", "tmpfs", str(path)],
                   check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def device(tmp_path) -> Path:
    """A 12 MiB ext4 filesystem of its own, on a loop device, that turns read-only on an
    error as a failing disk does (`turn_read_only`)."""
    image, path = tmp_path / "device.img", tmp_path / "device"
    path.mkdir()
    with open(image, "wb") as f:
        f.truncate(12 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(path)],
                   check=True)
    yield path
    loop = subprocess.run(["losetup", "-j", str(image)], capture_output=True,
                          text=True).stdout.split(":")[0]
    subprocess.run(["umount", "-l", str(path)], check=False)
    if loop:
        subprocess.run(["losetup", "-d", loop], check=False)


def turn_read_only(device: Path) -> None:
    """What ext4 does when the disk under it fails: every write from now on is EROFS,
    to files already open too."""
    with open("/proc/mounts") as mounts:
        source = next(line.split()[0] for line in mounts if line.split()[1] == str(device))
    with open(f"/sys/fs/ext4/{Path(source).name}/trigger_fs_error", "w") as f:
        f.write("bucketfs test\n")


def fill_up(device: Path) -> None:
    """Take whatever room is left on the device."""
    with open(device / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 64 * KiB)
            f.flush()


def read_all(mnt: Path, names) -> None:
    for name in names:
        assert (mnt / name).read_bytes() == FILES[name], name


def warnings_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]


def args(cache: Path) -> tuple[str, ...]:
    return ("--cache-dir", str(cache), "--disk-cache", "64MiB", "--disk-free-floor", "0",
            "--ram-cache", "4MiB", "--block-size", "1MiB")


def test_a_full_device_keeps_serving_from_the_bucket(bucket, small_tmpfs, tmp_path):
    device = small_tmpfs
    with mounted(f"file://{bucket}", tmp_path / "mnt", *args(device / "cache")) as mnt:
        read_all(mnt, FILL)  # more than the device holds: the SSD tier steps aside
        fill_up(device)      # and the index has no room left either
        assert tree(mnt) == tree(bucket)  # new directories, listed now: kept in memory
        drop_page_cache()
        read_all(mnt, FILES)
    found = warnings_in(read_log(tmp_path / "mnt.log"))
    assert any("SSD tier stops taking writes" in w for w in found), found
    assert any("kept in memory" in w for w in found), found
    assert len(found) <= 3, found  # one per thing that stepped aside, not one per read
    assert "Traceback" not in read_log(tmp_path / "mnt.log")


def test_a_device_turned_read_only_keeps_serving(bucket, device, tmp_path):
    with mounted(f"file://{bucket}", tmp_path / "mnt", *args(device / "cache")) as mnt:
        read_all(mnt, list(FILL)[:5])
        turn_read_only(device)
        read_all(mnt, list(FILL)[5:20])
        assert tree(mnt) == tree(bucket)
        drop_page_cache()
        read_all(mnt, FILES)
    log = read_log(tmp_path / "mnt.log")
    assert any("SSD tier stops taking writes" in w for w in warnings_in(log)), log
    assert "Traceback" not in log


def test_a_cache_directory_removed_while_mounted(bucket, device, tmp_path):
    cache = device / "cache"
    with mounted(f"file://{bucket}", tmp_path / "mnt", *args(cache)) as mnt:
        read_all(mnt, list(FILL)[:8])
        # Moved away first: the daemon may write into it while it is being deleted.
        cache.rename(device / "removed")
        shutil.rmtree(device / "removed", ignore_errors=True)
        drop_page_cache()
        read_all(mnt, list(FILL)[:12])
        assert tree(mnt) == tree(bucket)
    assert "Traceback" not in read_log(tmp_path / "mnt.log")


@pytest.mark.parametrize("state", ["read-only", "full"])
def test_an_unusable_device_at_mount_gives_a_ram_only_mount(bucket, device, small_tmpfs,
                                                            tmp_path, state):
    device = device if state == "read-only" else small_tmpfs
    cache = device / "cache"
    with mounted(f"file://{bucket}", tmp_path / "first", *args(cache)) as mnt:
        read_all(mnt, list(FILL)[:2])  # a cache to come back to
    if state == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(device)], check=True)
    else:
        fill_up(device)
    with mounted(f"file://{bucket}", tmp_path / "mnt", *args(cache)) as mnt:
        assert tree(mnt) == tree(bucket)
        read_all(mnt, FILES)
    log = read_log(tmp_path / "mnt.log")
    assert "Traceback" not in log
    # One line says what happened, and the mount goes on without the SSD tier.
    (warning,) = warnings_in(log)
    reason = "Read-only file system" if state == "read-only" else "No space left on device"
    assert f"cannot use cache directory {cache}" in warning and reason in warning, warning
    assert warning.endswith("caching in RAM only"), warning


def test_without_a_cache_directory_listings_go_to_disk_not_tmp(bucket, tmp_path):
    # /tmp is often a tmpfs: RAM outside every budget. The tree goes to the cache home.
    home = tmp_path / "cache-home"
    before = set(Path("/tmp").glob("*tree*"))
    with mounted(f"file://{bucket}", tmp_path / "mnt",
                 env={"XDG_CACHE_HOME": str(home)}) as mnt:
        assert tree(mnt) == tree(bucket)
        trees = list((home / "bucketfs").glob("tree-*"))
        assert len(trees) == 1 and any(trees[0].iterdir())
        assert stat.S_IMODE((home / "bucketfs").stat().st_mode) == 0o700
        assert set(Path("/tmp").glob("*tree*")) == before
    assert not list((home / "bucketfs").glob("tree-*"))  # removed at unmount
