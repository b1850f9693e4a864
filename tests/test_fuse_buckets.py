"""Real FUSE mounts of a real S3 server (SeaweedFS) and a real GCS emulator
(fake-gcs-server): the tree and bytes match the objects, edge-case keys included."""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import os
import random
from pathlib import Path

import pytest

from tests.mounting import (
    daemon_pid,
    drop_page_cache,
    expected_tree,
    metrics,
    mounted,
    read_log,
    tree,
)
from tests.servers import free_ports

pytestmark = pytest.mark.fuse

MiB = 1024**2


def edge_case_objects() -> dict[str, bytes]:
    rng = random.Random(11)
    return {
        "data/a": b"hidden by the prefix data/a/",
        "data/a/inner.txt": b"inner\n",
        "data/marker/": b"",
        "data/marker/x.bin": rng.randbytes(1000),
        "data/empty-marker/": b"",
        "data/with space.txt": b"space\n",
        "data/ünïcødé-名前.txt": b"unicode\n",
        "data/100%+plus=sign&.txt": b"percent plus\n",
        "data/zero-bytes": b"",
        "data/dbl//slash": b"skipped: empty segment",
        "data/./dot": b"skipped: dot segment",
        "data/../dotdot": b"skipped: dotdot segment",
        "data/" + "L" * 256: b"skipped: too long",
        "data/" + "é" * 127: b"kept: 254 bytes",
        "data/train/cls0/img0.jpg": rng.randbytes(110_000),
        "data/train/cls0/img1.jpg": rng.randbytes(90_000),
        "data/train/cls1/img0.jpg": rng.randbytes(120_000),
        "data/large.bin": rng.randbytes(12 * MiB + 3),
        "outside/not-mounted.txt": b"outside the prefix\n",
    }


OBJECTS = edge_case_objects()


def stored_objects(scheme: str, server, bucket: str) -> dict[str, bytes]:
    """Every object as the server holds it, read back with the SDK. Servers refuse or
    rewrite some keys (SeaweedFS rejects '.', '..' and long segments and folds '//'), so
    the mount is compared with what is stored, not with what was sent."""
    if scheme == "s3":
        client = server.client()
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket) for o in page.get("Contents", [])]
        return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}
    return {b.name: b.download_as_bytes() for b in server.client().list_blobs(bucket)}


@pytest.fixture(scope="module", params=["s3", "gs"])
def remote(request):
    """(url, env, extra mount args, objects as stored) for a populated bucket."""
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    bucket = f"edge-{request.param}"
    server.create_bucket(bucket)
    for key, data in OBJECTS.items():
        try:
            server.put(bucket, key, data)
        except Exception as exc:  # the server refuses this key; see stored_objects
            print(f"{request.param} server refused {key[:40]!r}: {exc}")
    stored = stored_objects(request.param, server, bucket)
    args = ("--addressing-style", "path") if request.param == "s3" else ()
    return f"{request.param}://{bucket}", server.env(), args, stored


@pytest.fixture(scope="module")
def mount(remote, tmp_path_factory):
    url, env, args, _ = remote
    mnt = tmp_path_factory.mktemp("mnt") / "data"
    with mounted(f"{url}/data", mnt, *args, env=env) as path:
        yield path


def test_tree_and_bytes_match_the_objects(remote, mount):
    stored = remote[3]
    for key in ("data/a", "data/a/inner.txt", "data/marker/", "data/empty-marker/",
                "data/with space.txt", "data/ünïcødé-名前.txt", "data/100%+plus=sign&.txt",
                "data/zero-bytes", "data/" + "é" * 127):
        assert stored[key] == OBJECTS[key], f"the server did not store {key!r} as sent"
    expected = expected_tree(stored, "data/")
    assert tree(mount) == expected
    assert expected["a"] == "dir"  # the prefix a/ hides the object a
    assert expected["empty-marker"] == "dir"


def test_sizes_and_mtimes(mount):
    for key, data in OBJECTS.items():
        path = mount / key.removeprefix("data/")
        if key.startswith("data/train/") or key == "data/large.bin":
            st = os.stat(path)
            assert st.st_size == len(data)
            assert st.st_mtime > 1.6e9  # from the listing, not the epoch


def test_random_ranged_reads(mount):
    data = OBJECTS["data/large.bin"]
    rng = random.Random(5)
    fd = os.open(mount / "large.bin", os.O_RDONLY)
    try:
        for _ in range(100):
            offset = rng.randrange(0, len(data) + 100)
            length = rng.choice([1, 4096, 131072, 3 * MiB])
            assert os.pread(fd, length, offset) == data[offset:offset + length]
        assert os.pread(fd, 1, len(data)) == b""
    finally:
        os.close(fd)


def test_prefix_with_no_objects_mounts_empty(remote, tmp_path):
    url, env, args, _ = remote
    with mounted(f"{url}/no/such/prefix", tmp_path / "mnt", *args, env=env) as mnt:
        assert os.listdir(mnt) == []


def test_whole_bucket_mount_shows_both_prefixes(remote, tmp_path):
    url, env, args, _ = remote
    with mounted(url, tmp_path / "mnt", *args, env=env) as mnt:
        assert sorted(os.listdir(mnt)) == ["data", "outside"]
        assert (mnt / "outside/not-mounted.txt").read_bytes() == OBJECTS[
            "outside/not-mounted.txt"]


def test_gcs_objects_stored_gzip_encoded_read_as_stored(gcs_server, tmp_path):
    """Objects uploaded with `gcloud storage cp -Z` (stored gzip-encoded) read as the
    bytes GCS stores, the size the listing gives: one small, one of several blocks."""
    bucket = "gzip-gs"
    gcs_server.create_bucket(bucket)
    rng = random.Random(17)
    stored = {"small.json.gz": gzip.compress(b'{"label": 3}\n' * 5_000),
              "shard.tar.gz": gzip.compress(rng.randbytes(9 * MiB) + bytes(MiB))}
    for key, data in stored.items():
        blob = gcs_server.client().bucket(bucket).blob(key)
        blob.content_encoding = "gzip"
        blob.upload_from_string(data, retry=None)
    with mounted(f"gs://{bucket}", tmp_path / "mnt", "--block-size", "2MiB",
                 env=gcs_server.env()) as mnt:
        for key, data in stored.items():
            assert os.stat(mnt / key).st_size == len(data)
            assert (mnt / key).read_bytes() == data, key
        drop_page_cache()
        data = stored["shard.tar.gz"]
        fd = os.open(mnt / "shard.tar.gz", os.O_RDONLY)
        try:
            for start in (5 * MiB + 17, 123, len(data) - 1000):
                assert os.pread(fd, 300_000, start) == data[start:start + 300_000], start
        finally:
            os.close(fd)
        assert gzip.decompress((mnt / "small.json.gz").read_bytes()).count(b"label") == 5_000


def read_large_from_three_places(mnt: Path) -> None:
    """large.bin read by three threads at once, from different offsets in steps of
    different sizes, every piece checked."""
    data = OBJECTS["data/large.bin"]

    def read_from(offset: int, size: int) -> None:
        fd = os.open(mnt / "large.bin", os.O_RDONLY)
        try:
            for start in range(offset, len(data), size):
                assert os.pread(fd, size, start) == data[start:start + size], start
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(read_from, (0, 5 * MiB + 17, 9 * MiB), (MiB, 65536, 300_000)))


@pytest.mark.parametrize("huge, block", [("never", MiB), ("always", 2 * MiB)])
def test_large_blocks_through_a_small_ram_tier_reuse_memory_and_stay_exact(
        remote, tmp_path, huge, block):
    """A 12 MiB object read in blocks through a RAM tier of three: every block evicts
    one, whose memory a later GET fills (spare_buffers.py), while readers at other
    offsets still read theirs. Every byte stays exact, pass after pass. Blocks of 1 MiB
    land in private mappings; of 2 MiB with `--huge-buffers always`, in mappings of huge
    pages (huge_buffers.py)."""
    url, env, args, _ = remote
    (port,) = free_ports(1)
    with mounted(f"{url}/data", tmp_path / "mnt", *args, "--ram-cache", str(3 * block),
                 "--block-size", str(block), "--readahead-max", str(2 * block),
                 "--huge-buffers", huge, "--metrics-port", str(port), env=env) as mnt:
        for _ in range(2):
            drop_page_cache()
            read_large_from_three_places(mnt)
        scrape = metrics(port)
    assert scrape["bucketfs_buffers_reused_total"] > 0
    assert scrape["bucketfs_buffers_spare_bytes"] <= 2 * block
    assert f"large block buffers in huge pages: {'yes' if huge == 'always' else 'no'}" \
        in read_log(tmp_path / "mnt.log")


def test_huge_page_buffers_serve_exact_bytes_from_the_origin_and_the_ssd_tier(
        remote, tmp_path):
    """2 MiB blocks in buffers of huge pages (`--huge-buffers always`, huge_buffers.py):
    read cold through a RAM tier that evicts as it goes, twice (the second time from the
    SSD tier), then from the SSD tier alone after a remount, whose direct reads land in
    huge pages too. The object's last block is 3 bytes. Every byte stays exact."""
    url, env, args, _ = remote
    options = [*args, "--huge-buffers", "always", "--block-size", "2MiB",
               "--ram-cache", "4MiB", "--readahead-max", "2MiB",
               "--cache-dir", str(tmp_path / "cache")]

    served = []
    for passes in (2, 1):
        (port,) = free_ports(1)
        with mounted(f"{url}/data", tmp_path / "mnt", *options, "--metrics-port", str(port),
                     env=env) as mnt:
            for _ in range(passes):
                drop_page_cache()
                read_large_from_three_places(mnt)
            served.append(metrics(port))
        assert "large block buffers in huge pages: yes" in read_log(tmp_path / "mnt.log")
    assert served[0]["bucketfs_buffers_fresh_total"] == 6  # the 2 MiB blocks' GETs
    assert served[1]['bucketfs_origin_requests_total{kind="get"}'] == 0
    assert served[1]['bucketfs_cache_hits_total{tier="ssd"}'] > 0


def test_changed_object_is_never_served_mixed(remote, tmp_path, request):
    """Overwrite an object while a handle has it open: that handle fails with EIO rather
    than mixing versions, and a new open reads the new bytes."""
    url, env, args, _ = remote
    server = request.getfixturevalue("s3_server" if url.startswith("s3") else "gcs_server")
    bucket = url.split("://")[1]
    key = "changing/file.bin"
    old, new = random.Random(1).randbytes(3 * MiB), random.Random(2).randbytes(3 * MiB)
    server.put(bucket, key, old)
    with mounted(f"{url}/changing", tmp_path / "mnt", *args, "--block-size", "1MiB",
                 "--readahead-max", "1MiB", env=env) as mnt:
        fd = os.open(mnt / "file.bin", os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == old[:4096]
            server.put(bucket, key, new)
            try:
                data = os.pread(fd, MiB, 2 * MiB)
            except OSError as exc:
                assert exc.errno == 5  # EIO
            else:
                assert data == old[2 * MiB:3 * MiB], "bytes of the new version leaked"
        finally:
            os.close(fd)
        log = read_log(tmp_path / "mnt.log")
        if "changed in the bucket" in log:
            with open(mnt / "file.bin", "rb") as f:
                assert hashlib.sha256(f.read()).digest() == hashlib.sha256(new).digest()


def test_worker_threads_never_preempt_the_fuse_thread(remote, tmp_path):
    """The daemon's worker threads run under SCHED_BATCH; the thread serving FUSE
    requests keeps the default policy (bucketfs/workers.py says why). A read starts no
    obstore runtime (tokio threads): its GET is libcurl's, on that thread. A mount of
    its own: a worker thread idle for 10 s ends, and the mount's start runs one."""
    url, env, args, _ = remote
    with mounted(f"{url}/data", tmp_path / "mnt", *args, env=env) as mount:
        check_thread_policies(mount)


def check_thread_policies(mount: Path) -> None:
    assert (mount / "train/cls1/img0.jpg").read_bytes() == OBJECTS["data/train/cls1/img0.jpg"]
    pid = daemon_pid(mount)
    policies: dict[str, set[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        kind = "fuse" if int(tid) == pid else name.rstrip("0123456789 ")
        policies.setdefault(kind, set()).add(os.sched_getscheduler(int(tid)))
    assert policies["fuse"] == {os.SCHED_OTHER}
    assert policies["Trio thread"] == {os.SCHED_BATCH}
    assert not any(kind.startswith("tokio") for kind in policies), policies
