"""Metrics as Prometheus sees them: every series reads the mount's own counters at
scrape time, the latency histogram counts every attempt, and /metrics is served."""

from __future__ import annotations

import random
import re
import socket
import time
import urllib.request

import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bucketfs import fs
from bucketfs import metrics as metrics_module
from bucketfs.backends.retry import RetryPolicy
from bucketfs.backends.store import ObjectStore
from bucketfs.cache.blocks import BlockId, ObjectRef
from bucketfs.cache.disk import DiskTier
from bucketfs.cache.ram import RamTier
from bucketfs.cache.tiered import BlockCache
from bucketfs.data_jobs import Setup
from bucketfs.dispatch import DataProcesses
from bucketfs.loop_load import ServingLoad
from bucketfs.metrics import build_registry, start_metrics_server
from bucketfs.prefetch.eviction import make_policy
from bucketfs.reader import ByteBudget, Reader, ReadSettings
from tests.membackend import MemoryBackend

KiB = 1024
BLOCK = 256 * KiB


def objects() -> dict[str, bytes]:
    rng = random.Random(7)
    return {"small/a": rng.randbytes(100 * KiB), "small/b": rng.randbytes(90 * KiB),
            "small/c": rng.randbytes(80 * KiB), "big": rng.randbytes(3 * BLOCK + 10)}


def run_mount(backend, body, *, directory=None, ram=1024 * KiB):
    """Run `body(cache, reader, registry)` in a mount-like setup; return the registry."""
    out = {}

    async def main():
        disk = None
        if directory is not None:
            disk = DiskTier(directory, 16 * BLOCK, make_policy("lru"), source=backend.url,
                            block_size=BLOCK)
        async with trio.open_nursery() as nursery:
            store = ObjectStore(backend, max_workers=4, retry=RetryPolicy(3, 0.0, 0.0))
            cache = BlockCache(store, RamTier(ram, make_policy("lru")), disk,
                               block_size=BLOCK, nursery=nursery)
            reader = Reader(cache, ByteBudget(4 * BLOCK),
                            ReadSettings(readahead_initial=BLOCK, readahead_max=4 * BLOCK),
                            nursery)
            out["registry"] = build_registry(cache, store, reader)
            await body(cache, reader, out["registry"])
            await settle(cache, reader)
            nursery.cancel_scope.cancel()
        if disk is not None:
            disk.close()

    trio.run(main)
    return out["registry"]


async def settle(cache: BlockCache, reader: Reader) -> None:
    """Wait until no read-ahead or write-through is under way."""
    with trio.fail_after(5):
        while cache.writing or cache.inflight or reader.budget.used:
            await trio.sleep(0.01)


def ref(backend: MemoryBackend, key: str) -> ObjectRef:
    return ObjectRef(key, backend.version(key), len(backend.objects[key]))


def value(registry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_scrape_reports_the_counters_of_cache_store_and_reader(tmp_path):
    backend = MemoryBackend(objects())
    backend.failures["small/b"] = 1  # one transient failure: one retry
    seen = {}

    async def body(cache, reader, registry):
        a, b = ref(backend, "small/a"), ref(backend, "small/b")
        await cache.get(a, 0)  # miss
        await cache.get(a, 0)  # RAM hit
        await cache.get(b, 0)  # miss after one retry
        await settle(cache, reader)  # both written through to SSD
        cache.ram.remove(BlockId(a.key, a.version, 0, size=a.size))
        await cache.get(a, 0)  # SSD hit
        big = reader.open("big", backend.version("big"), len(backend.objects["big"]))
        offset = 0
        while data := await reader.read(big, offset, 64 * KiB):
            offset += len(data)
        await settle(cache, reader)
        # Read from start to end and on SSD: the big object's blocks left RAM. Brought
        # back from SSD, RAM holds all of the above; one more block evicts (once all is
        # on SSD, so nothing evicted is read again while its write-through is under way).
        seen["released"] = cache.stats.ram_released
        for index in range(4):
            await cache.get(ref(backend, "big"), index)  # SSD hits
        assert cache.ram.evictions == 0
        await cache.get(ref(backend, "small/c"), 0)
        await settle(cache, reader)
        seen["prefetches"] = reader.prefetches
        seen["ram_evictions"] = cache.ram.evictions
        seen["ram_used"] = cache.ram.used
        seen["disk_used"] = cache.disk.used
        seen["misses"] = cache.stats.misses

    registry = run_mount(backend, body, directory=tmp_path / "cache")
    gets = backend.calls["get"]
    assert gets == 3 + 1 + 4  # the three small ones, small/b again, big's four blocks
    assert value(registry, "bucketfs_cache_hits_total", tier="ram") >= 1
    assert value(registry, "bucketfs_cache_hits_total", tier="ssd") == 1 + 4
    assert value(registry, "bucketfs_cache_served_bytes_total", tier="ssd") == \
        100 * KiB + len(backend.objects["big"])
    assert value(registry, "bucketfs_cache_ram_released_total") == seen["released"] == 4
    assert value(registry, "bucketfs_cache_misses_total") == seen["misses"] == 7
    assert value(registry, "bucketfs_origin_requests_total", kind="get") == gets
    assert value(registry, "bucketfs_origin_requests_total", kind="head") == 0
    assert value(registry, "bucketfs_origin_requests_total", kind="list") == 0
    assert value(registry, "bucketfs_origin_retries_total") == 1
    assert value(registry, "bucketfs_origin_bytes_total") == \
        sum(len(data) for data in backend.objects.values())
    assert value(registry, "bucketfs_cache_evictions_total", tier="ram") \
        == seen["ram_evictions"] > 0
    assert value(registry, "bucketfs_cache_used_bytes", tier="ram") == seen["ram_used"]
    assert value(registry, "bucketfs_cache_capacity_bytes", tier="ram") == 1024 * KiB
    assert value(registry, "bucketfs_cache_used_bytes", tier="ssd") == seen["disk_used"] > 0
    assert value(registry, "bucketfs_cache_capacity_bytes", tier="ssd") == 16 * BLOCK
    assert value(registry, "bucketfs_cache_ssd_writable") == 1
    assert value(registry, "bucketfs_readahead_prefetches_total") == seen["prefetches"] > 0
    assert value(registry, "bucketfs_readahead_inflight_bytes") == 0
    assert value(registry, "bucketfs_readahead_budget_bytes") == 4 * BLOCK
    # The histogram counts every attempt, failed ones too.
    assert value(registry, "bucketfs_origin_request_seconds_count", kind="get") == gets
    assert value(registry, "bucketfs_origin_request_seconds_bucket", kind="get",
                 le="+Inf") == gets
    assert value(registry, "bucketfs_origin_request_seconds_sum", kind="get") > 0
    assert value(registry, "bucketfs_origin_request_seconds_count", kind="head") == 0


def test_exposition_is_valid_and_every_name_is_prefixed():
    backend = MemoryBackend(objects())

    async def body(cache, reader, registry):
        await cache.get(ref(backend, "small/a"), 0)

    registry = run_mount(backend, body)
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(name.startswith("bucketfs_") for name in families)
    assert families["bucketfs_origin_request_seconds"].type == "histogram"
    assert families["bucketfs_cache_hits"].type == "counter"
    assert families["bucketfs_cache_used_bytes"].type == "gauge"
    buckets = [s for s in families["bucketfs_origin_request_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["kind"] == "get"]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and counts[-1] == 1  # cumulative, ending in the count


def test_without_an_ssd_tier_there_are_no_ssd_series():
    backend = MemoryBackend(objects())

    async def body(cache, reader, registry):
        await cache.get(ref(backend, "small/a"), 0)

    registry = run_mount(backend, body)
    assert value(registry, "bucketfs_cache_misses_total") == 1
    assert value(registry, "bucketfs_cache_hits_total", tier="ram") == 0
    assert value(registry, "bucketfs_cache_hits_total", tier="ssd") is None
    assert value(registry, "bucketfs_cache_used_bytes", tier="ssd") is None
    assert value(registry, "bucketfs_cache_ssd_writable") is None


def test_scrapes_read_live_values():
    backend = MemoryBackend(objects())
    scrapes = []

    async def body(cache, reader, registry):
        a = ref(backend, "small/a")
        await cache.get(a, 0)
        scrapes.append(value(registry, "bucketfs_cache_hits_total", tier="ram"))
        await cache.get(a, 0)
        scrapes.append(value(registry, "bucketfs_cache_hits_total", tier="ram"))

    run_mount(backend, body)
    assert scrapes == [0, 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_are_served_over_http():
    backend = MemoryBackend(objects())

    async def body(cache, reader, registry):
        await cache.get(ref(backend, "small/a"), 0)

    registry = run_mount(backend, body)
    port = free_port()
    start_metrics_server(port, "127.0.0.1", registry)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    assert "bucketfs_cache_misses_total 1.0" in text
    assert 'bucketfs_origin_requests_total{kind="get"} 1.0' in text
    assert "python_gc" not in text  # our registry, not the process-global one


def test_the_documented_list_is_exactly_what_a_mount_exports(tmp_path):
    """bucketfs/metrics.py's docstring is the list users (and the Grafana dashboard) read."""
    from bucketfs.cache.shared import SharedTier
    from bucketfs.cache.shared_names import Dataset
    from bucketfs.namespace import Namespace
    from bucketfs.prefetch.scheduler import PrefetchScheduler
    from bucketfs.prefetcher import HintedPrefetch
    from tests.memshared import MemorySharedStore

    documented = set(re.findall(r"^\s+(bucketfs_[a-z_]+)", metrics_module.__doc__, re.M))
    backend = MemoryBackend(objects())
    out = {}

    async def main():
        disk = DiskTier(tmp_path / "cache", 16 * BLOCK, make_policy("lru"),
                        source=backend.url, block_size=BLOCK)
        async with trio.open_nursery() as nursery:
            store = ObjectStore(backend, max_workers=4, retry=RetryPolicy(1))
            shared = SharedTier(MemorySharedStore(), Dataset("mem://bucket", "mem://bucket/",
                                                              "", BLOCK),
                                nursery, max_object=BLOCK, write_queue=BLOCK)
            cache = BlockCache(store, RamTier(BLOCK, make_policy("lru")), disk,
                               block_size=BLOCK, nursery=nursery, shared=shared)
            reader = Reader(cache, ByteBudget(4 * BLOCK), ReadSettings(), nursery)
            namespace = Namespace(store, "")
            prefetch = HintedPrefetch(
                namespace, cache, PrefetchScheduler(window_bytes=BLOCK, budget_bytes=BLOCK),
                connections=1, block_size=BLOCK)
            data = DataProcesses([Setup("mem://bucket/", {}, 0, 1, None, "mem")], -1)
            registry = build_registry(cache, store, reader, prefetch, ServingLoad(), data)
            out["names"] = {family.name for family in registry.collect()}
            namespace.close()
            nursery.cancel_scope.cancel()
        disk.close()

    trio.run(main)
    # prometheus_client reports counters without their _total suffix.
    exported = {n + "_total" if n + "_total" in documented else n for n in out["names"]}
    assert exported == documented


def test_data_processes_counters_add_to_the_mounts_own():
    """With data processes, a scrape shows the sums of what they last reported (those
    of one that exited kept) on top of the daemon's own counters; levels only from the
    running ones."""
    backend = MemoryBackend(objects())
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            store = ObjectStore(backend, max_workers=4, retry=RetryPolicy(1))
            cache = BlockCache(store, RamTier(BLOCK, make_policy("lru")), None,
                               block_size=BLOCK, nursery=nursery)
            reader = Reader(cache, ByteBudget(4 * BLOCK), ReadSettings(), nursery)
            key = "small/a"
            await reader.read(reader.open(key, backend.version(key), 100 * KiB), 0, 10)
            out["own_ram"] = cache.ram.used
            data = DataProcesses([Setup("mem://bucket/", {}, n, 2, None, "mem")
                                  for n in range(2)], -1)
            first, second = data.slots
            first.counts = {"cache_misses": 5, "origin_get": 6, "reader_opens": 7,
                            "failed_reads": 1, "level_ram_used": 100, "cpu_us": 2_000_000}
            second.counts = {"cache_misses": 1, "level_ram_used": 50}
            data._gone(second)  # exited: its counters stay, what it held does not
            out["registry"] = build_registry(cache, store, reader, None, None, data)
            nursery.cancel_scope.cancel()

    failed_before = fs.request_failures["read"]
    trio.run(main)
    registry = out["registry"]
    assert value(registry, "bucketfs_cache_misses_total") == 1 + 5 + 1
    assert value(registry, "bucketfs_origin_requests_total", kind="get") == 1 + 6
    assert value(registry, "bucketfs_fuse_opens_total") == 1 + 7
    assert value(registry, "bucketfs_fuse_errors_total",
                 operation="read") == failed_before + 1
    assert value(registry, "bucketfs_cache_used_bytes", tier="ram") == out["own_ram"] + 100
    assert value(registry, "bucketfs_data_process_cpu_seconds_total") == 2.0
    assert value(registry, "bucketfs_data_processes") == 2


def test_the_serving_threads_cpu_is_that_threads_alone():
    """A scrape (from another thread) reads the CPU of the thread that made the
    ServingLoad, not its own, and the daemon's in all."""
    backend = MemoryBackend(objects())
    loads = {}

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    async def main():
        loads["serving"] = ServingLoad()
        async with trio.open_nursery() as nursery:
            store = ObjectStore(backend, max_workers=1, retry=RetryPolicy(1))
            cache = BlockCache(store, RamTier(BLOCK, make_policy("lru")), None,
                               block_size=BLOCK, nursery=nursery)
            reader = Reader(cache, ByteBudget(BLOCK), ReadSettings(), nursery)
            registry = build_registry(cache, store, reader, load=loads["serving"])
            scrape = {}

            def scrape_twice() -> None:  # as the metrics server's thread does
                scrape["before"] = value(registry, "bucketfs_serving_thread_cpu_seconds_total")
                burn(0.2)  # this thread's CPU: not the serving thread's
                scrape["between"] = value(registry, "bucketfs_serving_thread_cpu_seconds_total")
                scrape["daemon"] = value(registry, "bucketfs_daemon_cpu_seconds_total")

            await trio.to_thread.run_sync(scrape_twice)
            first = value(registry, "bucketfs_serving_thread_cpu_seconds_total")
            burn(0.2)  # the serving thread's own
            second = value(registry, "bucketfs_serving_thread_cpu_seconds_total")
            nursery.cancel_scope.cancel()
        assert scrape["between"] - scrape["before"] < 0.1
        assert second - first >= 0.19
        assert scrape["daemon"] >= scrape["between"] + 0.19  # the scraping thread's burn

    trio.run(main)
