"""A cache directory reused with other settings, another prefix or another endpoint never
serves bytes or listings that are not the ones asked for: an entry names the origin, the
object version and size and the byte span it holds, and a hit must be that span.

The defect this guards against: a cache filled with 4 MiB blocks, remounted with 1 MiB
blocks, served 11 of 40 random ranges of a large object from the wrong offsets."""

from __future__ import annotations

import concurrent.futures
import random

import pytest

from tests.mounting import drop_page_cache, expected_tree, mounted, tree

pytestmark = [pytest.mark.fuse, pytest.mark.root]

KiB, MiB = 1024, 1024**2
BIG = random.Random(7).randbytes(9 * MiB + 5)
SMALL = {f"p1/s{i}.bin": random.Random(i).randbytes(100 * KiB + i) for i in range(6)}
OTHER = {f"p2/x/o{i}.bin": random.Random(100 + i).randbytes(50 * KiB + i) for i in range(4)}
OBJECTS = {"p1/big.bin": BIG, **SMALL, **OTHER}


@pytest.fixture(scope="module")
def bucket(s3_server):
    s3_server.create_bucket("identity")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: s3_server.put("identity", *kv), OBJECTS.items()))
    return "identity"


def object_gets(proxy) -> int:
    return proxy.count("GET") - proxy.count("GET", "list-type=2")


def random_ranges(path, seed: int, count: int = 40) -> list[tuple[int, int]]:
    """Ranges of `path` whose bytes differ from the object's (start, length)."""
    rng = random.Random(seed)
    wrong = []
    with open(path, "rb") as f:
        for _ in range(count):
            start = rng.randrange(len(BIG))
            length = rng.randrange(1, 3 * MiB)
            f.seek(start)
            if f.read(length) != BIG[start:start + length]:
                wrong.append((start, length))
    return wrong


def test_a_changed_block_size_serves_exact_bytes_and_shares_whole_objects(
        s3_server, bucket, fault_proxy, tmp_path):
    proxy = fault_proxy(s3_server.endpoint)
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    cache = tmp_path / "cache"

    def mount(block_size: str):
        return mounted("s3://identity/p1", tmp_path / "mnt", "--addressing-style", "path",
                       "--cache-dir", str(cache), "--block-size", block_size,
                       "--disk-free-floor", "0", env=env)

    with mount("4MiB") as mnt:
        assert (mnt / "big.bin").read_bytes() == BIG
        for name, data in SMALL.items():
            assert (mnt / name.removeprefix("p1/")).read_bytes() == data
    for block_size, seed in (("1MiB", 1), ("4MiB", 2), ("3MiB", 3)):
        proxy.clear()
        with mount(block_size) as mnt:
            drop_page_cache()
            assert random_ranges(mnt / "big.bin", seed) == []
            # Objects smaller than both block sizes are the same entry for both.
            for name, data in SMALL.items():
                assert (mnt / name.removeprefix("p1/")).read_bytes() == data
            assert proxy.count("GET", "p1/s") == 0, "small files were fetched again"
            if block_size == "4MiB":  # the layout the cache was filled with
                assert object_gets(proxy) == 0
            else:  # the big object's blocks of another size come from the bucket
                assert proxy.count("GET", "p1/big.bin") > 0


def test_listings_of_another_prefix_are_never_reused(s3_server, bucket, tmp_path):
    cache = tmp_path / "cache"
    args = ("--addressing-style", "path", "--cache-dir", str(cache), "--disk-free-floor", "0")
    env = s3_server.env()
    for url, prefix in (("s3://identity/p1", "p1/"), ("s3://identity/p2", "p2/"),
                        ("s3://identity", ""), ("s3://identity/p1", "p1/")):
        with mounted(url, tmp_path / "mnt", *args, env=env) as mnt:
            assert tree(mnt) == expected_tree(OBJECTS, prefix), url


def test_the_same_bucket_through_another_endpoint_shares_no_entries(
        s3_server, bucket, fault_proxy, tmp_path):
    # Two stores may hold buckets of the same name: the endpoint is part of the origin.
    first, second = fault_proxy(s3_server.endpoint), fault_proxy(s3_server.endpoint)
    cache = tmp_path / "cache"
    args = ("--addressing-style", "path", "--cache-dir", str(cache), "--disk-free-floor", "0")
    for proxy in (first, second):
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        with mounted("s3://identity/p1", tmp_path / "mnt", *args, env=env) as mnt:
            for name, data in SMALL.items():
                assert (mnt / name.removeprefix("p1/")).read_bytes() == data
        assert object_gets(proxy) == len(SMALL)
        assert proxy.count("GET", "list-type=2") >= 1
