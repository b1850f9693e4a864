"""The shared tier through real mounts: two mounts with their own cache directories stand
for two nodes; the origin is a bucket on the S3 server behind a request-counting proxy,
the shared tier another bucket on the same server."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import random
import re
import time

import pytest

from bucketfs.cache.blocks import BlockId
from bucketfs.cache.shared_names import Dataset, SharedNames, block_id, describe
from tests.mounting import bucketfs, mounted, read_log, status_json

pytestmark = [pytest.mark.fuse, pytest.mark.root]

KiB, MiB = 1024, 1024**2
FILES = {f"train/c{i % 3}/{i:03d}.jpg": random.Random(i).randbytes(40 * KiB + i * 131)
         for i in range(40)}
FILES["train/mid.bin"] = random.Random(77).randbytes(3 * MiB + 17)  # 4 blocks, shared
FILES["train/big.bin"] = random.Random(78).randbytes(5 * MiB + 3)  # over the size limit
SHARED_BLOCKS = 40 + 4
BIG_BLOCKS = 6
ORIGIN, SHARED = "origin", "sharedtier"


@pytest.fixture(scope="module")
def buckets(s3_server):
    s3_server.create_bucket(ORIGIN)
    s3_server.create_bucket(SHARED)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: s3_server.put(ORIGIN, *kv), FILES.items()))


@pytest.fixture
def nodes(s3_server, buckets, fault_proxy, tmp_path, request):
    """Mount arguments of two nodes sharing a tier (under a prefix of the shared bucket
    that is this test's own), and the proxy counting the origin's requests."""
    proxy = fault_proxy(s3_server.endpoint)
    env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    tier = f"s3://{SHARED}/{request.node.name}/"

    def args(node: str, *extra: str) -> tuple[str, ...]:
        return ("--addressing-style", "path", "--block-size", "1MiB",
                "--cache-dir", str(tmp_path / f"cache-{node}"), "--disk-free-floor", "0",
                "--shared-cache", tier, "--shared-cache-endpoint-url", s3_server.endpoint,
                "--shared-cache-max-object", "4MiB", *extra)

    return proxy, env, args, tier


def read_all(mnt) -> None:
    def check(item):
        name, data = item
        assert (mnt / name.removeprefix("train/")).read_bytes() == data, name

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(check, FILES.items()))


def object_gets(proxy) -> int:
    return proxy.count("GET") - proxy.count("GET", "list-type=2")


def shared_objects(s3_server, tier: str) -> dict[str, int]:
    prefix = tier.removeprefix(f"s3://{SHARED}/")
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(
        Bucket=SHARED, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", ())}


def test_a_second_node_reads_the_dataset_without_the_origin(s3_server, nodes, tmp_path):
    proxy, env, args, tier = nodes
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "a", *args("a"), env=env) as mnt:
        read_all(mnt)
        assert object_gets(proxy) == SHARED_BLOCKS + BIG_BLOCKS
    blocks = [k for k in shared_objects(s3_server, tier) if "/blocks/" in k]
    # Written in the background and drained at unmount: every small object's block,
    # none of the object over --shared-cache-max-object.
    assert len(blocks) == SHARED_BLOCKS
    proxy.clear()
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "b", *args("b"), env=env) as mnt:
        read_all(mnt)
        assert object_gets(proxy) == BIG_BLOCKS, "the second node went to the origin"
        report = status_json(mnt)
        shared = report["shared"]
        assert shared["hits"] == SHARED_BLOCKS and shared["invalid"] == 0
        assert shared["errors"] == 0 and shared["up"] is True
        assert report["cache"]["hit_ratio"]["shared"] > 0
        assert shared["writes"] == 0  # nothing new came from the origin but big.bin
        text = bucketfs("status", str(mnt))
        assert "hits 44" in text.stdout, text.stdout
    # The other block size is another dataset: no collision, no hits.
    proxy.clear()
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "c", *args("c", "--block-size", "2MiB"),
                 env=env) as mnt:
        read_all(mnt)
        assert status_json(mnt)["shared"]["hits"] == 0
    # And so is another prefix of the same bucket.
    with mounted(f"s3://{ORIGIN}/train/c0", tmp_path / "d", *args("d"), env=env) as mnt:
        assert (mnt / "000.jpg").read_bytes() == FILES["train/c0/000.jpg"]
        assert status_json(mnt)["shared"]["hits"] == 0


def _plant(s3_server, name: str, body: bytes, metadata: dict[str, str]) -> None:
    s3_server.client().put_object(Bucket=SHARED, Key=name, Body=body, Metadata=metadata)


def test_corrupt_foreign_and_stale_objects_are_misses(s3_server, nodes, tmp_path):
    proxy, env, args, tier = nodes
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "a", *args("a"), env=env) as mnt:
        read_all(mnt)
        source = status_json(mnt)["mount"]["endpoint"]
    head = s3_server.client().head_object
    objects = {}
    for key in ("train/c0/000.jpg", "train/c1/001.jpg", "train/c2/002.jpg",
                "train/c0/003.jpg", "train/c1/004.jpg", "train/c2/005.jpg"):
        etag = head(Bucket=ORIGIN, Key=key)["ETag"].strip('"')
        objects[key] = BlockId(key, etag, 0, size=len(FILES[key]))
    dataset = Dataset(f"s3://{ORIGIN} via {source}", f"s3://{ORIGIN}/train/", "train/", MiB)
    names = SharedNames(tier.removeprefix(f"s3://{SHARED}/"))
    name = {key: names.block(dataset, block) for key, block in objects.items()}
    assert all(n in shared_objects(s3_server, tier) for n in name.values()), \
        "the names the test computes are not the ones the mount wrote"

    meta = functools.partial(describe, dataset)
    a, b, c, d, e, f = objects
    # Corrupt: one byte changed, the metadata left as written.
    good = meta(objects[a], FILES[a])
    _plant(s3_server, name[a], bytes([FILES[a][0] ^ 1]) + FILES[a][1:], good)
    # Foreign: another block's object (body and metadata), copied under this name.
    _plant(s3_server, name[b], FILES[c], meta(objects[c], FILES[c]))
    # Stale: an earlier version's bytes, described as that version.
    old = BlockId(d, "0123456789abcdef0123456789abcdef", 0, size=len(FILES[d]))
    old_bytes = random.Random(5).randbytes(len(FILES[d]))
    _plant(s3_server, name[d], old_bytes, meta(old, old_bytes))
    # Torn: the first half, under the full block's metadata.
    _plant(s3_server, name[e], FILES[e][: len(FILES[e]) // 2], meta(objects[e], FILES[e]))
    # Bare: the right bytes and no metadata at all.
    _plant(s3_server, name[f], FILES[f], {})
    planted = 5
    proxy.clear()
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "b", *args("b"), env=env) as mnt:
        read_all(mnt)  # every byte exact
        shared = status_json(mnt)["shared"]
        assert shared["invalid"] == planted
        assert shared["hits"] == SHARED_BLOCKS - planted
        assert object_gets(proxy) == BIG_BLOCKS + planted
        # The origin's bytes replace what was planted, for the next node.
        assert shared["writes"] == planted
    log = read_log(tmp_path / "b.log")
    assert len(re.findall(r"shared tier: .* is not block 0 of", log)) == planted, log
    for reason in ("do not match their SHA-256", "its key is 'train/c2/002.jpg'", "its version is",
                   "bytes where", "no format in its metadata"):
        assert reason in log, reason
    assert block_id(dataset, objects[a]) in name[a]


@pytest.mark.parametrize("outage", ["refuse", "blackhole", "refuse-writes"])
def test_a_shared_tier_that_fails_turns_into_misses(s3_server, nodes, tmp_path,
                                                    fault_proxy, outage):
    proxy, env, args, _ = nodes
    shared_proxy = fault_proxy(s3_server.endpoint)
    if outage == "refuse-writes":  # a full or throttling tier: reads work, writes fail
        shared_proxy.add_rule(method="PUT", action="status:503")
    else:
        shared_proxy.outage(outage)
    extra = ("--shared-cache-endpoint-url", shared_proxy.endpoint,
             "--shared-cache-timeout", "0.5")
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "a", *args("a"), *extra,
                 env=env) as mnt:
        read_all(mnt)
        assert object_gets(proxy) == SHARED_BLOCKS + BIG_BLOCKS
        report = status_json(mnt)
        shared = report["shared"]
        assert shared["errors"] >= 1 and shared["up"] is False
        assert shared["hits"] == 0 and shared["writes"] == 0
        if outage != "refuse-writes":
            # Resting: later lookups and writes are not even tried.
            assert shared["skipped"] > 0 and shared["lookups"] < SHARED_BLOCKS
        assert report["errors"]["background_failures"] == 0
    log = read_log(tmp_path / "a.log")
    warnings = [line for line in log.splitlines()
                if "WARNING" in line and "shared tier" in line]
    assert len(warnings) == 1, log
    assert "the origin serves every read" in warnings[0]
    assert s3_server.secret_key not in log


def test_the_shared_tier_comes_back(s3_server, nodes, tmp_path, fault_proxy):
    _, env, args, _ = nodes
    shared_proxy = fault_proxy(s3_server.endpoint)
    shared_proxy.outage("refuse")
    extra = ("--shared-cache-endpoint-url", shared_proxy.endpoint)
    keys = sorted(name.removeprefix("train/") for name in FILES)
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "a", *args("a"), *extra,
                 env=env) as mnt:
        assert (mnt / keys[0]).read_bytes() == FILES[f"train/{keys[0]}"]
        assert status_json(mnt)["shared"]["up"] is False
        shared_proxy.restore()
        deadline = time.monotonic() + 20
        index = 1
        while not status_json(mnt)["shared"]["up"]:  # resting one second, then tried again
            assert time.monotonic() < deadline, "the shared tier was never tried again"
            assert (mnt / keys[index]).read_bytes() == FILES[f"train/{keys[index]}"]
            index += 1
            time.sleep(0.3)
        assert status_json(mnt)["shared"]["hits"] + status_json(mnt)["shared"]["misses"] > 0
    assert "answers again" in read_log(tmp_path / "a.log")


def test_one_datasets_shared_blocks_are_listed_and_cleared(s3_server, nodes, tmp_path):
    proxy, env, args, tier = nodes
    for node, url in (("a", f"s3://{ORIGIN}/train"), ("c", f"s3://{ORIGIN}/train/c1")):
        with mounted(url, tmp_path / node, *args(node), env=env) as mnt:
            read_all(mnt) if node == "a" else (mnt / "001.jpg").read_bytes()
    admin = ("--endpoint-url", s3_server.endpoint, "--addressing-style", "path")
    listed = bucketfs("cache", "shared-list", tier, *admin, "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    datasets = {d["url"]: d for d in json.loads(listed.stdout)}
    assert datasets[f"s3://{ORIGIN}/train/"]["blocks"] == SHARED_BLOCKS
    assert datasets[f"s3://{ORIGIN}/train/c1/"]["blocks"] == 1
    assert datasets[f"s3://{ORIGIN}/train/"]["bytes"] == sum(
        len(data) for name, data in FILES.items() if name != "train/big.bin")
    cleared = bucketfs("cache", "shared-clear", tier, f"s3://{ORIGIN}/train", *admin, env=env)
    assert cleared.returncode == 0, cleared.stderr
    assert f"{SHARED_BLOCKS} blocks" in cleared.stdout
    left = bucketfs("cache", "shared-list", tier, *admin, env=env)
    assert f"s3://{ORIGIN}/train/c1/" in left.stdout and "1 dataset(s)" in left.stdout
    again = bucketfs("cache", "shared-clear", tier, f"s3://{ORIGIN}/train", *admin, env=env)
    assert again.returncode == 1 and "no dataset" in again.stderr
    proxy.clear()
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "b", *args("b"), env=env) as mnt:
        read_all(mnt)
        assert object_gets(proxy) == SHARED_BLOCKS + BIG_BLOCKS  # all from the origin again


def settled(mnt, files: int) -> dict:
    """The status once hinted prefetch has started `files` files and none is in flight."""
    deadline = time.monotonic() + 30
    while True:
        report = status_json(mnt)
        prefetch = report["prefetch"]
        if prefetch["started"] >= files and prefetch["in_flight"] == 0:
            return report
        assert time.monotonic() < deadline, f"prefetch never settled: {prefetch}"
        time.sleep(0.1)


def test_hinted_prefetch_looks_in_the_shared_tier_and_fills_it(s3_server, nodes, tmp_path):
    """Node A is hinted one shard and reads nothing itself: its prefetch alone fills the
    tier. Node B, hinted the whole dataset in another order, prefetches that shard from
    the shared tier and only the rest from the origin."""
    from bucketfs.hints import send_order

    proxy, env, args, _ = nodes
    small = sorted(name.removeprefix("train/") for name in FILES if name.endswith(".jpg"))
    shard = small[::2]
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "a", *args("a"), env=env) as mnt:
        assert send_order([str(mnt / name) for name in reversed(shard)], epoch=0,
                          job="node-a", strict=True)
        report = settled(mnt, len(shard))
        assert report["reads"]["requests"] == 0
        assert report["shared"]["lookups"] == len(shard)  # prefetch looked there first
        assert object_gets(proxy) == len(shard)
    proxy.clear()
    order = small[:]
    random.Random(3).shuffle(order)
    with mounted(f"s3://{ORIGIN}/train", tmp_path / "b", *args("b"), env=env) as mnt:
        assert send_order([str(mnt / name) for name in order], epoch=0, job="node-b",
                          strict=True)
        report = settled(mnt, len(small))
        assert report["shared"]["hits"] == len(shard)
        assert object_gets(proxy) == len(small) - len(shard)
        for name in order:
            assert (mnt / name).read_bytes() == FILES[f"train/{name}"], name
        assert object_gets(proxy) == len(small) - len(shard)  # nothing fetched twice


@pytest.mark.parametrize("tier", [f"s3://{ORIGIN}/train/cache", f"s3://{ORIGIN}/"])
def test_a_shared_tier_overlapping_the_mount_is_refused(s3_server, buckets, tmp_path, tier):
    (tmp_path / "mnt").mkdir()
    result = bucketfs("mount", f"s3://{ORIGIN}/train", str(tmp_path / "mnt"),
                      "--addressing-style", "path", "--shared-cache", tier,
                      env=s3_server.env())
    assert result.returncode == 1
    assert "overlaps the mount" in result.stderr and "prefix of its own" in result.stderr

