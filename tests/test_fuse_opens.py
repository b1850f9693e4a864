"""Who opens files: the kernel (`kernel_opens`, FUSE no_open, on bucketfs's patched
pyfuse3) or the daemon (`--no-kernel-opens`, or a stock pyfuse3). Both return exact
bytes for every way of reading; with the kernel opening, a reread its page cache holds
asks the daemon nothing at all, while the daemon-opened mount is asked to open each
time. `make venv` builds the patched pyfuse3, so its absence here is a failure."""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from bucketfs.fs import PATCHED_PYFUSE3
from tests.mounting import mounted
from tests.test_fuse_status_warm import status_json

pytestmark = pytest.mark.fuse

KiB, MiB = 1024, 1024**2
FILES = {f"train/c{i % 4}/{i:03d}.jpg": random.Random(i).randbytes(30 * KiB + 101 * i)
         for i in range(24)}
FILES["big/blob.bin"] = random.Random(5).randbytes(9 * MiB + 13)
FILES["empty.txt"] = b""


@pytest.fixture(scope="module")
def bucket(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bucket")
    for key, data in FILES.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return root


def read_whole(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check_every_way_of_reading(mnt: Path) -> None:
    for key, data in FILES.items():
        assert read_whole(mnt / key) == data, key
    blob, data = mnt / "big/blob.bin", FILES["big/blob.bin"]
    rng = random.Random(11)
    with open(blob, "rb", buffering=0) as f:
        # A file whose first read is far from its start, then backwards and across blocks.
        for offset, size in [(7 * MiB + 5, 3 * MiB), (123, 4096), (1 * MiB - 3, 2 * MiB)] + [
                (rng.randrange(len(data)), rng.randrange(1, 2 * MiB)) for _ in range(30)]:
            assert os.pread(f.fileno(), size, offset) == data[offset:offset + size]
    with open(blob, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
        assert view[5 * MiB:5 * MiB + 777] == data[5 * MiB:5 * MiB + 777]
        assert view[-10:] == data[-10:]
    # Two readers of one file at once, one from its start, one from its middle.
    with open(blob, "rb", buffering=0) as a, open(blob, "rb", buffering=0) as b:
        assert a.read(MiB) == data[:MiB]
        assert os.pread(b.fileno(), MiB, 4 * MiB) == data[4 * MiB:5 * MiB]
        assert a.read(MiB) == data[MiB:2 * MiB]


def reread_small_files(mnt: Path, times: int) -> None:
    for _ in range(times):
        for key, data in FILES.items():
            if not key.startswith("big/"):
                assert read_whole(mnt / key) == data


def settled_reads(mnt: Path) -> dict:
    """The daemon's read counters once they stop moving (the kernel's asynchronous
    read-ahead for the reads before may still be arriving)."""
    reads = status_json(mnt)["reads"]
    for _ in range(50):
        time.sleep(0.1)
        now = status_json(mnt)["reads"]
        if now == reads:
            return reads
        reads = now
    raise AssertionError("the daemon's read counters never settled")


def reread_from_the_page_cache(mnt: Path, rounds: int = 3) -> tuple[dict, dict]:
    """The daemon's read counters before and after 5 rereads of the small files.

    This VM reclaims memory behind the kernel's back (DAMON pageout: 150 GB paged out
    since boot when looked at), so a page read a moment ago can be gone, and a reread
    then reaches the daemon: CI saw 1 and 3 such READs. A round that saw a READ is run
    again after reading the files into the page cache once more; a mount whose rereads
    do reach the daemon fails every round."""
    for _ in range(rounds):
        reread_small_files(mnt, times=1)
        before = settled_reads(mnt)
        reread_small_files(mnt, times=5)
        after = status_json(mnt)["reads"]
        if after["requests"] == before["requests"]:
            break
    return before, after


def test_kernel_opens_exact_bytes_and_page_cache_rereads_ask_nothing(bucket, tmp_path):
    assert PATCHED_PYFUSE3, "run `make venv`: it builds pyfuse3 with bucketfs's patch"
    with mounted(f"file://{bucket}", tmp_path / "mnt") as mnt:
        report = status_json(mnt)
        assert report["mount"]["kernel_opens"] is True
        check_every_way_of_reading(mnt)
        assert status_json(mnt)["reads"]["opens"] >= len(FILES) - 1  # empty: never read
        before, after = reread_from_the_page_cache(mnt)
        # The kernel opened, read from its page cache and closed 5 x 26 files itself.
        assert after == before


def test_daemon_opens_exact_bytes_and_each_open_reaches_the_daemon(bucket, tmp_path):
    with mounted(f"file://{bucket}", tmp_path / "mnt", "--no-kernel-opens") as mnt:
        assert status_json(mnt)["mount"]["kernel_opens"] is False
        check_every_way_of_reading(mnt)
        before, after = reread_from_the_page_cache(mnt)
        small = sum(1 for key in FILES if not key.startswith("big/"))
        assert after["opens"] - before["opens"] == 5 * small
        # keep_cache: the page cache still answers the reads themselves.
        assert after["requests"] == before["requests"]


@pytest.mark.root  # fusectl shows a connection's settings to root
def test_kernel_background_reaches_the_kernel(bucket, tmp_path):
    connections = Path("/sys/fs/fuse/connections")
    if not os.path.ismount(connections):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(connections)], check=True)
    with mounted(f"file://{bucket}", tmp_path / "mnt", "--kernel-background", "40") as mnt:
        # A connection is named by the device number of its mount (major 0).
        settings = connections / str(os.minor(os.stat(mnt).st_dev))
        assert int((settings / "max_background").read_text()) == 40
        assert int((settings / "congestion_threshold").read_text()) == 30


def test_kernel_opens_with_a_ram_tier_smaller_than_a_block(bucket, tmp_path):
    """Each read state then keeps its last block (the kernel reads a 4 MiB block in
    smaller requests): still exact bytes, every way."""
    with mounted(f"file://{bucket}", tmp_path / "mnt", "--ram-cache", "1MiB") as mnt:
        check_every_way_of_reading(mnt)
