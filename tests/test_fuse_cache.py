"""The cache through a real mount of a real S3 server, requests counted by a proxy: a
second epoch and a remount go without GETs; a kill -9 while filling never yields torn
bytes; a cache directory in use is refused; a large file read through leaves the RAM
tier to the rest, and the memory it let go takes later reads from the SSD tier."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
import signal
import subprocess
import time

import pytest

from tests.mounting import (
    bucketfs,
    daemon_pid,
    drop_page_cache,
    force_unmount,
    metrics,
    mounted,
    sha256_file,
    status_json,
    written_through,
)

pytestmark = [pytest.mark.fuse, pytest.mark.root]

KiB, MiB = 1024, 1024**2
FILES = {f"train/c{i % 4}/{i:04d}.jpg": random.Random(i).randbytes(60 * KiB + i * 97)
         for i in range(120)}
FILES["big/blob.bin"] = random.Random(99).randbytes(9 * MiB + 5)


@pytest.fixture(scope="module")
def bucket(s3_server):
    s3_server.create_bucket("cached")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: s3_server.put("cached", *kv), FILES.items()))
    return "cached"


@pytest.fixture
def counted(s3_server, bucket, fault_proxy):
    proxy = fault_proxy(s3_server.endpoint)
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    return proxy, env


def read_everything(mnt) -> None:
    for name, data in FILES.items():
        assert (mnt / name).read_bytes() == data, name


def object_gets(proxy) -> int:
    return proxy.count("GET") - proxy.count("GET", "list-type=2")


def lists(proxy) -> int:
    return proxy.count("GET", "list-type=2")


def test_second_epoch_and_remount_issue_no_get_and_no_list(counted, tmp_path):
    proxy, env = counted
    args = ("--addressing-style", "path", "--cache-dir", str(tmp_path / "cache"),
            "--block-size", "1MiB", "--disk-free-floor", "0")
    with mounted("s3://cached", tmp_path / "mnt", *args, env=env) as mnt:
        read_everything(mnt)
        first = object_gets(proxy)
        assert first == 120 + 10  # one GET per image, ten 1 MiB blocks for the big one
        drop_page_cache()
        read_everything(mnt)
        assert object_gets(proxy) == first
    proxy.clear()
    with mounted("s3://cached", tmp_path / "mnt", *args, env=env) as mnt:
        drop_page_cache()
        read_everything(mnt)
        assert object_gets(proxy) == 0, "a remount went back to the bucket for data"
        assert lists(proxy) == 0, "a remount listed the bucket again"
        # The access check, by an object it already knew, and the bucket's region.
        assert proxy.count("HEAD") == 2
    proxy.clear()
    with mounted("s3://cached", tmp_path / "mnt", *args, "--refresh", env=env) as mnt:
        assert sorted(os.listdir(mnt / "train")) == ["c0", "c1", "c2", "c3"]
        assert lists(proxy) >= 2  # --refresh asks the bucket again


def test_saved_listings_expire_with_the_metadata_ttl(counted, tmp_path):
    proxy, env = counted
    args = ("--addressing-style", "path", "--cache-dir", str(tmp_path / "cache"),
            "--metadata-ttl", "1")
    with mounted("s3://cached", tmp_path / "mnt", *args, env=env) as mnt:
        assert len(os.listdir(mnt / "train/c0")) == 30
    time.sleep(1.2)
    proxy.clear()
    with mounted("s3://cached", tmp_path / "mnt", *args, env=env) as mnt:
        assert len(os.listdir(mnt / "train/c0")) == 30
        assert lists(proxy) >= 3  # root, train/, train/c0/ listed again


def test_ram_only_cache_serves_a_second_epoch(counted, tmp_path):
    proxy, env = counted
    with mounted("s3://cached", tmp_path / "mnt", "--addressing-style", "path",
                 env=env) as mnt:
        read_everything(mnt)
        first = object_gets(proxy)
        drop_page_cache()
        read_everything(mnt)
        assert object_gets(proxy) == first


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.8])
def test_kill_9_while_filling_then_remount_is_byte_exact(counted, tmp_path, delay):
    _, env = counted
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cache = tmp_path / "cache"
    args = ("--addressing-style", "path", "--cache-dir", str(cache), "--block-size", "256KiB",
            "--disk-free-floor", "0")
    result = bucketfs("mount", "s3://cached", str(mnt), *args, env=env)
    assert result.returncode == 0, result.stderr
    pid = daemon_pid(mnt)
    names = list(FILES)
    random.Random(delay).shuffle(names)

    def reader():
        for name in names:
            try:
                (mnt / name).read_bytes()
            except OSError:
                return  # the daemon is gone

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(reader) for _ in range(4)]
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        for future in futures:
            future.result()
    force_unmount(mnt)  # the stale mount the killed daemon left
    with mounted("s3://cached", tmp_path / "mnt2", *args, env=env) as again:
        drop_page_cache()
        for name, data in FILES.items():
            assert sha256_file(again / name) == hashlib.sha256(data).hexdigest(), name


def test_cache_dir_in_use_is_refused(counted, tmp_path):
    _, env = counted
    args = ("--addressing-style", "path", "--cache-dir", str(tmp_path / "cache"))
    with mounted("s3://cached", tmp_path / "one", *args, env=env):
        (tmp_path / "two").mkdir()
        result = bucketfs("mount", "s3://cached", str(tmp_path / "two"), *args, env=env)
        assert result.returncode == 1
        assert "cannot use cache directory" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_full_cache_disk_degrades_without_errors_to_readers(counted, tmp_path):
    """The cache directory on a real 2 MiB tmpfs: the SSD tier fills, steps aside with one
    warning, and every read still returns the right bytes."""
    _, env = counted
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(tiny)], check=True)
    try:
        with mounted("s3://cached", tmp_path / "mnt", "--addressing-style", "path",
                     "--cache-dir", str(tiny / "cache"), "--disk-free-floor", "0",
                     "--ram-cache", "1MiB", env=env) as mnt:
            read_everything(mnt)
            drop_page_cache()
            read_everything(mnt)
        log = (tmp_path / "mnt.log").read_text()
        assert log.count("stops taking writes") == 1
    finally:
        subprocess.run(["umount", "-l", str(tiny)], check=False)


def test_metrics_endpoint_and_cache_commands(counted, tmp_path):
    from tests.servers import free_ports

    _, env = counted
    cache = tmp_path / "cache"
    (port,) = free_ports(1)
    with mounted("s3://cached", tmp_path / "mnt", "--addressing-style", "path",
                 "--cache-dir", str(cache), "--metrics-port", str(port), env=env) as mnt:
        read_everything(mnt)
        drop_page_cache()
        read_everything(mnt)
        written_through(mnt)  # the write-through may still be writing the last blocks
        values = metrics(port)
        # 4 MiB blocks: one per image and three for the 9 MiB object, each fetched once.
        assert values["bucketfs_cache_misses_total"] == 123
        assert values['bucketfs_origin_requests_total{kind="get"}'] == 123
        # The second pass: the images from RAM, the big object's three blocks from SSD,
        # or from the write-through queue if still there (read through in the first
        # pass, they left RAM: BlockCache.read_through); each pass lets them go.
        ram, ssd = (values[f'bucketfs_cache_hits_total{{tier="{tier}"}}']
                    for tier in ("ram", "ssd"))
        assert ram >= 120 and ssd <= 3 and ram + ssd >= 123
        assert values["bucketfs_cache_ram_released_total"] == 6
        assert values['bucketfs_cache_used_bytes{tier="ssd"}'] == sum(map(len, FILES.values()))
        busy = bucketfs("cache", "clear", str(cache))
        assert busy.returncode == 1 and "in use" in busy.stderr
    stats = bucketfs("cache", "stats", str(cache))
    assert stats.returncode == 0, stats.stderr
    assert "123" in stats.stdout  # the entries, and the misses of the one mount so far
    cleared = bucketfs("cache", "clear", str(cache))
    assert cleared.returncode == 0, cleared.stderr
    assert not (cache / "index").exists()


def test_unwritable_cache_dir_means_ram_only_with_a_warning(counted, tmp_path):
    _, env = counted
    readonly = tmp_path / "ro"
    readonly.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)],
                   check=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        result = bucketfs("mount", "s3://cached", str(mnt), "--addressing-style", "path",
                          "--cache-dir", str(readonly / "cache"), env=env)
        assert result.returncode == 0, result.stderr
        assert "caching in RAM only" in result.stderr
        read_everything(mnt)
    finally:
        bucketfs("umount", str(mnt))
        force_unmount(mnt)
        subprocess.run(["umount", "-l", str(readonly)], check=False)


def test_a_large_file_read_through_leaves_the_ram_tier_to_the_rest(counted, tmp_path):
    """The 9 MiB object read front to back through a 14 MiB RAM tier that holds the 120
    images (7.7 MiB): its blocks leave RAM as they are read (the page cache and the SSD
    tier hold them), so the images are still in RAM afterwards. Kept, the object's
    blocks would push images out to the SSD tier."""
    proxy, env = counted
    args = ("--addressing-style", "path", "--cache-dir", str(tmp_path / "cache"),
            "--block-size", "1MiB", "--ram-cache", "14MiB", "--readahead-max", "2MiB",
            "--disk-free-floor", "0")
    images = {name: data for name, data in FILES.items() if name.startswith("train/")}
    with mounted("s3://cached", tmp_path / "mnt", *args, env=env) as mnt:
        for name, data in images.items():
            assert (mnt / name).read_bytes() == data, name
        assert (mnt / "big/blob.bin").read_bytes() == FILES["big/blob.bin"]
        written_through(mnt)
        before = status_json(mnt)["cache"]
        drop_page_cache()
        for name, data in images.items():
            assert (mnt / name).read_bytes() == data, name
        after = status_json(mnt)["cache"]
    ram, ssd = (after["tiers"][i]["hits"] - before["tiers"][i]["hits"] for i in (0, 1))
    assert (ram, ssd) == (120, 0)
    assert before["tiers"][0]["released"] == 10  # nine 1 MiB blocks and a 5-byte tail
    assert object_gets(proxy) == 120 + 10


def test_a_large_file_read_again_from_ssd_reuses_the_memory_it_let_go(
        s3_server, counted, tmp_path):
    """Read from the SSD tier front to back after a remount, each 1 MiB block leaves RAM
    once read through, and its mapping takes the direct read of a later block: exact
    bytes, and most blocks read into memory already used (bucketfs/spare_buffers.py).
    A 32 MiB object of its own bucket: the first blocks of a pass get fresh memory (the
    read-ahead reads them before any block was read through)."""
    from tests.servers import free_ports

    proxy, env = counted
    s3_server.create_bucket("cached-large")
    blob = random.Random(32).randbytes(32 * MiB)
    s3_server.put("cached-large", "blob.bin", blob)
    (port,) = free_ports(1)
    args = ("--addressing-style", "path", "--cache-dir", str(tmp_path / "cache"),
            "--block-size", "1MiB", "--readahead-max", "4MiB", "--kernel-readahead",
            "128KiB", "--disk-free-floor", "0", "--metrics-port", str(port))
    with mounted("s3://cached-large", tmp_path / "mnt", *args, env=env) as mnt:
        assert (mnt / "blob.bin").read_bytes() == blob
        written_through(mnt)
    gets = object_gets(proxy)
    with mounted("s3://cached-large", tmp_path / "mnt", *args, env=env) as mnt:
        drop_page_cache()
        assert (mnt / "blob.bin").read_bytes() == blob
        values = metrics(port)
    assert object_gets(proxy) == gets  # all of it from the SSD tier
    reused = values["bucketfs_buffers_read_reused_total"]
    assert reused >= 16 and reused + values["bucketfs_buffers_read_fresh_total"] == 32
