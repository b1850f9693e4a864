"""The shared tier as code: names that never collide, checks that turn anything but the
right block into a miss, a write queue that never holds a reader, a failing tier that
rests and comes back, and the admin functions. Real buckets: tests/test_fuse_shared.py."""

from __future__ import annotations

import logging
import threading

import pytest
import trio

from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache import shared as shared_module
from bucketfs.cache.blocks import BlockId, ObjectRef
from bucketfs.cache.ram import RamTier
from bucketfs.cache.shared import SharedTier
from bucketfs.cache.shared_admin import clear_dataset, format_datasets, list_datasets
from bucketfs.cache.shared_names import (
    Dataset,
    SharedNames,
    describe,
    identity,
    mismatch,
)
from bucketfs.cache.tiered import BlockCache
from bucketfs.prefetch.eviction import make_policy
from tests.membackend import MemoryBackend
from tests.memshared import MemorySharedStore

KiB = 1024
BLOCK = 64 * KiB
DATASET = Dataset("s3://origin via http://127.0.0.1:1", "s3://origin/train/", "train/", BLOCK)
BLOCK_A = BlockId("train/a.jpg", "etag-a", 0, size=1000)


# --- names and checks -------------------------------------------------------------------


def test_every_part_of_the_identity_changes_the_name():
    names = SharedNames("tier/")
    base = names.block(DATASET, BLOCK_A)
    assert base.startswith("tier/bucketfs-v1/")
    others = {
        names.block(Dataset("s3://other via http://127.0.0.1:1", DATASET.url, "train/",
                            BLOCK), BLOCK_A),
        names.block(Dataset(DATASET.source, DATASET.url, "val/", BLOCK), BLOCK_A),
        names.block(Dataset(DATASET.source, DATASET.url, "train/", 2 * BLOCK), BLOCK_A),
        names.block(DATASET, BlockId("train/b.jpg", "etag-a", 0, size=1000)),
        names.block(DATASET, BlockId("train/a.jpg", "etag-b", 0, size=1000)),
        names.block(DATASET, BlockId("train/a.jpg", "etag-a", 1, size=1000)),
        # Length-prefixed parts: moving a character between two fields is another name.
        names.block(DATASET, BlockId("train/a.jpge", "tag-a", 0, size=1000)),
    }
    assert base not in others and len(others) == 7
    assert "a.jpg" not in base  # names say nothing of the keys


def test_metadata_is_header_safe_and_a_long_key_is_left_to_the_digest():
    odd = BlockId("train/é\n%/ü.jpg", '"v 1"', 3, size=10 * BLOCK)
    fields = describe(DATASET, odd, b"x" * BLOCK)
    assert all(value.isascii() and value.isprintable() for value in fields.values())
    assert fields["bucketfs-key"] == "train/%C3%A9%0A%25/%C3%BC.jpg"
    long = BlockId("k" * 1900, "v", 0, size=1)
    assert "bucketfs-key" not in identity(DATASET, long)
    assert "bucketfs-id" in identity(DATASET, long)


@pytest.mark.parametrize("change, reason", [
    (lambda m, d: (m, d[:-1]), "999 bytes where 1000"),
    (lambda m, d: (m, b"y" + d[1:]), "SHA-256"),
    (lambda m, d: ({**m, "bucketfs-version": "etag-b"}, d), "its version is 'etag-b'"),
    (lambda m, d: ({**m, "bucketfs-key": "train/b.jpg"}, d), "its key is 'train/b.jpg'"),
    (lambda m, d: ({**m, "bucketfs-block": "1"}, d), "its block is '1'"),
    (lambda m, d: ({**m, "bucketfs-block-size": "1"}, d), "its block-size is '1'"),
    (lambda m, d: ({k: v for k, v in m.items() if k != "bucketfs-id"}, d), "no id"),
    (lambda m, d: ({}, d), "no format"),
])
def test_anything_but_the_block_is_a_mismatch(change, reason):
    data = bytes(range(256)) * 3 + b"z" * 232
    metadata = describe(DATASET, BLOCK_A, data)
    assert mismatch(identity(DATASET, BLOCK_A), metadata, data, 1000) is None
    changed, body = change(metadata, data)
    found = mismatch(identity(DATASET, BLOCK_A), changed, body, 1000)
    assert found is not None and reason in found


# --- the tier ---------------------------------------------------------------------------


def run(body, store=None, **options):
    store = store or MemorySharedStore()

    async def main():
        async with trio.open_nursery() as nursery:
            tier = SharedTier(store, DATASET, nursery,
                              max_object=options.get("max_object", 10 * BLOCK),
                              write_queue=options.get("write_queue", 4 * BLOCK))
            await body(tier, store)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return store


def test_a_block_offered_is_found_and_checked():
    data = b"q" * 1000

    async def body(tier, store):
        assert await tier.get(BLOCK_A, 1000) is None
        tier.offer(BLOCK_A, data)
        await tier.drain(5)
        assert bytes(await tier.get(BLOCK_A, 1000)) == data
        assert await tier.get(BLOCK_A, 999) is None  # not the length expected: invalid
        assert (tier.stats.hits, tier.stats.misses, tier.stats.invalid) == (1, 1, 1)
        assert tier.stats.writes == 1 and tier.stats.bytes_written == 1000
        assert tier.stats.requests == {"get": 3, "put": 1, "list": 0, "delete": 0}

    store = run(body)
    assert list(store.stored) == [SharedNames("").block(DATASET, BLOCK_A)]


def test_a_full_write_queue_drops_blocks_instead_of_waiting():
    store = MemorySharedStore()
    store.put_gate = threading.Event()  # a tier that takes its time

    async def body(tier, store):
        for index in range(10):
            tier.offer(BlockId("k", "v", index, size=10 * BLOCK), b"b" * BLOCK)
        assert tier.stats.dropped == 6 and tier.queued == 4 * BLOCK  # the limit
        store.put_gate.set()
        await tier.drain(5)
        assert tier.queued == 0 and tier.stats.writes == 4

    run(body, store, write_queue=4 * BLOCK)


def test_drain_gives_up_after_its_time(caplog):
    store = MemorySharedStore()
    store.put_gate = threading.Event()

    async def body(tier, store):
        tier.offer(BLOCK_A, b"x" * 1000)
        with trio.fail_after(3):
            await tier.drain(0.2)
        store.put_gate.set()

    with caplog.at_level(logging.INFO):
        run(body, store)
    assert "not yet written to the shared tier" in caplog.text


def test_a_failing_tier_rests_warns_once_and_comes_back(caplog, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(shared_module.time, "monotonic", lambda: now[0])
    store = MemorySharedStore()
    store.failing = "shared tier s3://shared/: GET: connection refused"

    async def body(tier, store):
        assert await tier.get(BLOCK_A, 1000) is None
        assert not tier.up and tier.stats.errors == 1
        assert await tier.get(BLOCK_A, 1000) is None  # resting: not tried
        tier.offer(BLOCK_A, b"x" * 1000)  # writes are still tried: they fail too
        await tier.drain(5)
        assert store.calls == {"get": 1, "put": 1}
        assert tier.stats.skipped == 1 and tier.stats.errors == 2
        now[0] += 1.5  # past the first rest (1 s) of reads
        assert await tier.get(BLOCK_A, 1000) is None
        assert store.calls["get"] == 2  # tried again, failed again: resting 2 s now
        now[0] += 1.5
        assert await tier.get(BLOCK_A, 1000) is None and store.calls["get"] == 2
        store.failing = None
        now[0] += 1
        assert await tier.get(BLOCK_A, 1000) is None  # a plain miss: reads work again
        assert not tier.up  # writes are still resting
        now[0] += 60
        tier.offer(BLOCK_A, b"x" * 1000)
        await tier.drain(5)
        assert tier.up and tier.stats.writes == 1

    with caplog.at_level(logging.INFO):
        run(body, store)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the origin serves every read" in warnings[0].message
    assert "answers again" in caplog.text


def cache_over(backend: MemoryBackend, tier: SharedTier, nursery: trio.Nursery, *,
               ram: int = BLOCK) -> BlockCache:
    """A RAM-only block cache over `backend` with `tier` as its shared tier."""
    return BlockCache(ObjectStore(backend, max_workers=2, retry=RetryPolicy(1)),
                      RamTier(ram, make_policy("lru")), None, block_size=BLOCK,
                      nursery=nursery, shared=tier)


def test_the_cache_asks_the_shared_tier_before_the_origin_and_fills_it():
    objects = {"train/a.jpg": b"a" * 1000, "train/big.bin": b"b" * (3 * BLOCK)}
    backend = MemoryBackend(objects)
    store = MemorySharedStore()

    def node():
        async def main():
            async with trio.open_nursery() as nursery:
                tier = SharedTier(store, DATASET, nursery, max_object=2 * BLOCK,
                                  write_queue=8 * BLOCK)
                cache = cache_over(backend, tier, nursery, ram=16 * BLOCK)
                for key, data in objects.items():
                    ref = ObjectRef(key, backend.version(key), len(data))
                    got = [await cache.get(ref, i) for i in range(-(-len(data) // BLOCK))]
                    assert b"".join(bytes(g) for g in got) == data
                await tier.drain(5)
                nursery.cancel_scope.cancel()
                return cache.stats

        return trio.run(main)

    first = node()
    assert (first.misses, first.shared_hits) == (4, 0)
    assert len(store.stored) == 1  # big.bin is over max_object: never shared
    second = node()  # a fresh RAM tier: another node
    assert (second.misses, second.shared_hits) == (3, 1)
    assert backend.calls["get"] == 4 + 3


# --- the admin functions ----------------------------------------------------------------


def test_datasets_are_listed_and_cleared_one_at_a_time():
    store = MemorySharedStore("s3://shared/tier/")
    other = Dataset(DATASET.source, "s3://origin/val/", "val/", BLOCK)

    async def body(tier, store):
        await tier.announce()
        for index in range(3):
            tier.offer(BlockId("train/a", "v", index, size=9 * BLOCK), b"t" * 100)
        await tier.drain(5)

    run(body, store)
    names = SharedNames(store.prefix)
    store.put(names.descriptor(other), other.descriptor(), {})
    store.put(names.block(other, BLOCK_A), b"v" * 50, {})
    store.put(names.root + "0123/blocks/x", b"o" * 7, {})  # no descriptor
    datasets = {d.url: d for d in list_datasets(store)}
    assert datasets["s3://origin/train/"].blocks == 3
    assert datasets["s3://origin/train/"].bytes == 300
    assert datasets["s3://origin/val/"].blocks == 1 and datasets[None].id == "0123"
    text = format_datasets(list(datasets.values()))
    assert "3 dataset(s)" in text and "unknown dataset" in text
    (cleared,) = clear_dataset(store, "s3://origin/train")  # the URL as typed
    assert cleared.blocks == 3
    assert {d.url for d in list_datasets(store)} == {"s3://origin/val/", None}
    assert clear_dataset(store, "0123")[0].blocks == 1
    assert clear_dataset(store, "s3://nothing/here") == []
    assert [d.url for d in list_datasets(store)] == ["s3://origin/val/"]


def test_an_s3_express_directory_bucket_gets_session_auth(monkeypatch):
    from bucketfs.backends.s3 import open_object_store
    from bucketfs.backends.settings import BackendSettings

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    settings = BackendSettings(region="us-east-1")
    express, _ = open_object_store("cache--use1-az4--x-s3", settings)
    plain, endpoint = open_object_store("cache", settings)
    assert express.config.get("s3_express") == "true"
    assert "s3_express" not in plain.config and endpoint.endswith(".amazonaws.com")


def test_an_empty_object_never_reaches_the_shared_tier():
    backend = MemoryBackend({"train/empty": b""})
    store = MemorySharedStore()

    async def main():
        async with trio.open_nursery() as nursery:
            tier = SharedTier(store, DATASET, nursery, max_object=BLOCK, write_queue=BLOCK)
            cache = cache_over(backend, tier, nursery)
            # What hinted prefetch and warm ask for an empty file: its one (empty) block.
            empty = ObjectRef("train/empty", backend.version("train/empty"), 0)
            assert bytes(await cache.get(empty, 0)) == b""
            await tier.drain(5)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert store.calls == {}


def test_a_bug_in_a_lookup_is_a_miss_not_a_failed_read(monkeypatch):
    from bucketfs import tasks

    objects = {"train/a.jpg": b"a" * 1000}
    backend = MemoryBackend(objects)
    store = MemorySharedStore()

    def broken(name):
        raise RuntimeError("a bug in the shared tier's GET")

    monkeypatch.setattr(store, "get", broken)
    before = tasks.failures

    async def main():
        async with trio.open_nursery() as nursery:
            tier = SharedTier(store, DATASET, nursery, max_object=BLOCK, write_queue=BLOCK)
            cache = cache_over(backend, tier, nursery)
            ref = ObjectRef("train/a.jpg", backend.version("train/a.jpg"), 1000)
            assert bytes(await cache.get(ref, 0)) == objects["train/a.jpg"]
            assert tier.stats.errors == 1 and cache.stats.misses == 1
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert tasks.failures == before + 1
