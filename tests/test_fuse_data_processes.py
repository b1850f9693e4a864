"""`bucketfs mount --data-processes N` on a real S3 server (SeaweedFS) and a real GCS
emulator: reads served by data processes beside the daemon, each writing its replies to
the kernel itself (docs/DATA_PROCESSES.md). Bytes exact and version-pinned, each
process's SSD shard kept across a remount, counters summed in status and metrics, and a
data process that dies started again while the mount serves."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import random
import signal
import stat
import time
from pathlib import Path

import pytest

from bucketfs.cache.admin import SHARDS, cache_stats, clear_cache
from tests.mounting import (
    bucketfs,
    daemon_pid,
    drop_page_cache,
    metrics,
    mounted,
    read_log,
    status_json,
)
from tests.servers import free_ports

pytestmark = pytest.mark.fuse

MiB = 1024**2
rng = random.Random(23)
OBJECTS = {f"train/c{n % 3}/img{n}.jpg": rng.randbytes(rng.randrange(1, 150_000))
           for n in range(48)}
OBJECTS["large.bin"] = rng.randbytes(9 * MiB + 5)


@pytest.fixture(scope="module", params=["s3", "gs"])
def remote(request):
    """(url, env, extra mount args) of a populated bucket."""
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    bucket = f"data-procs-{request.param}"
    server.create_bucket(bucket)
    for key, data in OBJECTS.items():
        server.put(bucket, key, data)
    args = ("--addressing-style", "path") if request.param == "s3" else ()
    return f"{request.param}://{bucket}", server.env(), args


def data_processes(mountpoint: Path) -> list[int]:
    """The pids of the mount's data processes (children of its daemon)."""
    daemon = daemon_pid(mountpoint)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if parent == daemon and b"bucketfs.data_process" in command:
            found.append(int(pid))
    return sorted(found)


def read_all(mnt: Path) -> None:
    """Every object, by 8 threads at once, each compared with what the bucket holds;
    the large one also at offsets that cross its blocks."""
    def check(key: str) -> None:
        assert (mnt / key).read_bytes() == OBJECTS[key], key

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(check, sorted(OBJECTS)))
    data = OBJECTS["large.bin"]
    fd = os.open(mnt / "large.bin", os.O_RDONLY)
    try:
        for start in (4 * MiB - 100, 123, len(data) - 1000, 8 * MiB + 7):
            assert os.pread(fd, 300_000, start) == data[start:start + 300_000], start
    finally:
        os.close(fd)


def settled_status(mnt: Path) -> dict:
    """The status once the data processes' latest counters arrived (each reports once a
    second)."""
    time.sleep(1.5)
    return status_json(mnt)


def test_reads_served_by_data_processes_and_kept_in_their_shards(remote, tmp_path):
    url, env, args = remote
    cache_dir = tmp_path / "cache"
    (port,) = free_ports(1)
    common = (*args, "--cache-dir", str(cache_dir), "--block-size", "4MiB")
    with mounted(url, tmp_path / "mnt", *common, "--data-processes", "2",
                 "--metrics-port", str(port), env=env) as mnt:
        assert len(data_processes(mnt)) == 2
        read_all(mnt)
        status = settled_status(mnt)
        assert status["mount"]["data_processes"] == 2
        files = len(OBJECTS) - 1
        # Every small file and each block of the large one came from the bucket once,
        # fetched by the data processes (the daemon's own store only listed).
        assert status["cache"]["misses"] >= files + 3
        assert status["origin"]["requests"]["get"] >= files + 3
        assert status["reads"]["opens"] >= len(OBJECTS)
        scraped = metrics(port)
        assert scraped["bucketfs_data_processes"] == 2
        assert scraped["bucketfs_cache_misses_total"] == status["cache"]["misses"]
        assert scraped["bucketfs_data_process_cpu_seconds_total"] > 0
    shards = cache_dir / SHARDS
    assert sorted(p.name for p in shards.iterdir()) == ["0", "1"]
    held = cache_stats(cache_dir)  # `bucketfs cache stats` counts the shards' blocks
    assert held["shards"] == 2 and held["bytes"] == sum(map(len, OBJECTS.values()))
    for path in (shards, *shards.iterdir()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    # Remounted: each process finds its objects in its own shard; the bucket is not asked.
    with mounted(url, tmp_path / "mnt", *common, "--data-processes", "2", env=env) as mnt:
        drop_page_cache()
        read_all(mnt)
        status = settled_status(mnt)
        assert status["origin"]["requests"]["get"] == 0
        ssd = next(t for t in status["cache"]["tiers"] if t["name"] == "ssd")
        assert ssd["hits"] > 0 and ssd["used"] > 9 * MiB
    # With fewer processes, the shard of the second is deleted; bytes stay exact.
    with mounted(url, tmp_path / "mnt", *common, "--data-processes", "1", env=env) as mnt:
        read_all(mnt)
    assert sorted(p.name for p in shards.iterdir()) == ["0"]
    assert clear_cache(cache_dir) > 0 and not shards.exists()  # `bucketfs cache clear`


def test_a_data_process_that_dies_is_started_again(remote, tmp_path):
    url, env, args = remote
    with mounted(url, tmp_path / "mnt", *args, "--data-processes", "2", env=env) as mnt:
        read_all(mnt)
        first = data_processes(mnt)
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while len(replaced := data_processes(mnt)) < 2 or replaced == first:
            assert time.monotonic() < deadline, "the data process was not started again"
            time.sleep(0.1)
        time.sleep(1)  # until it has built its data path
        drop_page_cache()
        read_all(mnt)
        assert status_json(mnt)["mount"]["data_process_restarts"] == 1
    log = read_log(tmp_path / "mnt.log")
    assert "data process 0 exited (signal 9)" in log or "data process 1 exited (signal 9)" in log


def test_a_replaced_object_fails_its_old_version_and_new_opens_get_the_new(
        s3_server, tmp_path):
    """A version pinned by the name fails once the bucket replaced it (EIO, as one
    process does), and the daemon, told by the data process, looks the name up again
    for new opens (the listing is otherwise trusted for the life of the mount)."""
    bucket, key, new = "data-procs-changing", "train/c0/img0.jpg", b"replaced " * 1000
    s3_server.create_bucket(bucket)
    s3_server.put(bucket, key, OBJECTS[key])
    with mounted(f"s3://{bucket}", tmp_path / "mnt", "--addressing-style", "path",
                 "--data-processes", "2", "--kernel-ttl", "0", env=s3_server.env()) as mnt:
        assert os.stat(mnt / key).st_size == len(OBJECTS[key])
        fd = os.open(mnt / key, os.O_RDONLY)
        try:
            s3_server.put(bucket, key, new)
            with pytest.raises(OSError) as failed:
                os.pread(fd, 100, 0)
            assert failed.value.errno == errno.EIO
        finally:
            os.close(fd)
        deadline = time.monotonic() + 10
        while True:
            try:
                if (mnt / key).read_bytes() == new:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "new opens never saw the new version"
            time.sleep(0.2)


def test_warm_says_it_is_off_with_data_processes(remote, tmp_path):
    url, env, args = remote
    with mounted(url, tmp_path / "mnt", *args, "--data-processes", "1", env=env) as mnt:
        result = bucketfs("warm", str(mnt))
        assert result.returncode != 0
        assert "data processes" in result.stderr


def test_with_the_daemon_answering_opens_each_handle_reads_its_version(remote, tmp_path):
    """`--no-kernel-opens`: the daemon answers OPEN and RELEASE, and a read names a
    handle; its entry is kept per handle until RELEASE (nothing else is)."""
    url, env, args = remote
    with mounted(url, tmp_path / "mnt", *args, "--data-processes", "2",
                 "--no-kernel-opens", env=env) as mnt:
        read_all(mnt)
        drop_page_cache()
        read_all(mnt)
        status = settled_status(mnt)
        assert not status["mount"]["kernel_opens"]
        # The daemon's own reader opened nothing: each open counted once, by the data
        # process that read it (a read state per file: at its first read at offset 0).
        assert status["reads"]["opens"] <= 2 * (len(OBJECTS) + 4)
