"""`bucketfs status`: the daemon's live view of its mount, answered on the hints socket
(a STATUS request, docs/HINTS.md) and rendered by `bucketfs/status_view.py`.

The snapshot is built in the trio thread, from the very counters `/metrics` reads
(`bucketfs/metrics.py`): the cache's per-tier figures (`BlockCache.tiers`, `stats`), the
object store's request counts, the reader's read-ahead, hinted prefetch's snapshot and
counters, `tasks.failures`, and the warm jobs. So the two agree, and both agree with
what the origin saw: a request counts once per attempt, retries included. (The one
exception is the mount-time access check, a LIST or HEAD made before the mount's own
store exists: neither counts it.)

Only the rates need a history: a task samples the origin's byte and request counts, the
files opened, and the serving thread's and the daemon's CPU clocks
(`loop_load.ServingLoad`), once a second and keeps the last ten seconds, so the rates
shown are recent, not averages since the mount.
"""

from __future__ import annotations

import collections
import datetime
import os
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import trio

from bucketfs import __version__, fs, tasks
from bucketfs.backends.store import ObjectStore, RequestCounts
from bucketfs.backends.urls import BucketUrl
from bucketfs.cache.tiered import BlockCache, CacheStats
from bucketfs.config import Config
from bucketfs.data_jobs import LEVEL, Counts, merged
from bucketfs.dispatch import DataProcesses
from bucketfs.loop_load import ServingLoad
from bucketfs.prefetcher import HintedPrefetch
from bucketfs.reader import Reader
from bucketfs.warm import WarmJobs

#: Bumped when a key changes meaning or goes away (new keys may come at any time).
SCHEMA = 1
REQUEST_KINDS = ("get", "head", "list")
SAMPLE_S = 1.0
#: The throughput shown is over (at most) this many seconds.
RATE_WINDOW_S = 10.0
#: Files opened in the window below which the serving thread's time per file is not
#: shown: its other work (listings, status, prefetch planning) would dominate.
PER_FILE_MIN_OPENS = 100

#: List prices per 1,000 requests in USD, for an estimate of what the mount's requests
#: cost: storage in the Standard class, without data transfer (free to a node in the
#: bucket's region, priced per GB elsewhere). Sources, as of November 2026:
#: S3: https://aws.amazon.com/s3/pricing/ ("Requests & data retrievals", S3 Standard,
#:     US East (N. Virginia)): GET, SELECT and all other requests (HEAD) $0.0004;
#:     PUT, COPY, POST, LIST $0.005.
#: GCS: https://cloud.google.com/storage/pricing#operations-pricing (Standard storage
#:     in a region): Class B (objects.get, metadata reads) $0.0004; Class A
#:     (objects.list) $0.005.
#: Other regions and classes cost more or less: these are estimates, labelled so.
REQUEST_PRICES: dict[str, dict[str, float]] = {
    "s3": {"get": 0.0004, "head": 0.0004, "list": 0.005},
    "gs": {"get": 0.0004, "head": 0.0004, "list": 0.005},
}
PRICE_NAMES = {
    "s3": "AWS S3 Standard list prices (us-east-1)",
    "gs": "Google Cloud Storage Standard list prices (regional)",
}


class _Sample(NamedTuple):
    at: float  # monotonic
    origin_bytes: int
    origin_requests: int
    opens: int
    thread_cpu_s: float
    process_cpu_s: float


@dataclass(frozen=True, slots=True)
class MountFacts:
    """What the mount is, fixed at mount time."""

    url: str
    scheme: str
    endpoint: str
    mountpoint: str
    block_size: int
    metrics: str | None = None
    #: The kernel opens files itself (the `kernel_opens` option, on a patched pyfuse3).
    kernel_opens: bool = False


def facts_of(url: BucketUrl, mountpoint: str, config: Config, store: ObjectStore, *,
             kernel_opens: bool = False) -> MountFacts:
    metrics = f"{config.metrics_address}:{config.metrics_port}" if config.metrics_port \
        else None
    return MountFacts(str(url), url.scheme, getattr(store.backend, "endpoint", ""),
                      mountpoint, config.block_size, metrics,
                      kernel_opens=kernel_opens)


class MountStatus:
    """Builds the STATUS reply; `run` samples the origin's throughput and the CPU clocks."""

    def __init__(self, facts: MountFacts, cache: BlockCache, store: ObjectStore,
                 reader: Reader, prefetch: HintedPrefetch | None, warm: WarmJobs,
                 load: ServingLoad | None = None, data: DataProcesses | None = None,
                 ) -> None:
        """`load`: the serving thread's clocks (made in that thread); by default this
        thread's, which is the serving thread when the mount makes this. `data`: the
        mount's data processes, whose counters add to this process's."""
        self.load = load or ServingLoad()
        self.facts = facts
        self.cache = cache
        self.store = store
        self.reader = reader
        self.prefetch = prefetch
        self.warm = warm
        self.data = data
        self.started = time.time()
        self._began = time.monotonic()
        #: Oldest first.
        self._samples: collections.deque[_Sample] = collections.deque(
            maxlen=int(RATE_WINDOW_S / SAMPLE_S) + 1)
        self._sample()

    async def run(self) -> None:
        while True:
            await trio.sleep(SAMPLE_S)
            self._sample()

    def _sample(self) -> None:
        self._samples.append(self._now())

    def _extra(self) -> Counts:
        """The data processes' counters (nothing without them)."""
        return {} if self.data is None else self.data.counts()

    def _requests(self, extra: Counts | None = None) -> RequestCounts:
        counts = self.store.counts
        if self.data is None:
            return counts
        return merged(counts, self._extra() if extra is None else extra, "origin_")

    def _stats(self) -> CacheStats:
        stats = self.cache.stats
        return stats if self.data is None else merged(stats, self._extra(), "cache_")

    def _now(self) -> _Sample:
        extra = self._extra()  # summed over every process: once per sample
        counts = self._requests(extra)
        return _Sample(time.monotonic(), counts.bytes_fetched,
                       counts.get + counts.head + counts.list,
                       self.reader.opens + extra.get("reader_opens", 0),
                       self.load.thread_cpu_s(),
                       self.load.process_cpu_s() + extra.get("cpu_us", 0) / 1e6)

    # --- the snapshot (trio thread) ------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        extra = self._extra()
        return {
            "schema": SCHEMA,
            "mount": self._mount(),
            "load": self._load(),
            "cache": self._cache(),
            "reads": {"opens": self.reader.opens + extra.get("reader_opens", 0),
                      "requests": self.reader.reads + extra.get("reader_reads", 0),
                      "bytes": self.reader.bytes_read + extra.get("reader_bytes_read", 0)},
            "prefetch": self._prefetch(),
            "shared": self._shared(),
            "origin": self._origin(),
            "errors": self._errors(),
            "warm": self.warm.snapshot(),
        }

    def _mount(self) -> dict[str, Any]:
        facts = self.facts
        started = datetime.datetime.fromtimestamp(self.started, datetime.UTC)
        return {
            "url": facts.url,
            "endpoint": facts.endpoint or None,
            "mountpoint": facts.mountpoint,
            "pid": os.getpid(),
            "version": __version__,
            "started": started.isoformat(timespec="seconds"),
            "uptime_s": round(time.monotonic() - self._began, 1),
            "block_size": facts.block_size,
            "hints": self.prefetch is not None,
            "kernel_opens": facts.kernel_opens,
            "metrics": facts.metrics,
            # Processes serving reads beside the daemon (0: it serves them itself).
            "data_processes": 0 if self.data is None else self.data.count,
            "data_process_restarts": 0 if self.data is None else self.data.restarts,
        }

    def _cache(self) -> dict[str, Any]:
        stats, disk, extra = self._stats(), self.cache.disk, self._extra()
        served = {"ram": (stats.ram_hits, stats.ram_bytes_served),
                  "ssd": (stats.disk_hits, stats.disk_bytes_served)}
        tiers = []
        for tier in self.cache.tiers:
            hits, served_bytes = served[tier.name]
            entry: dict[str, Any] = {
                "name": tier.name,
                "used": tier.used + extra.get(f"{LEVEL}{tier.name}_used", 0),
                "capacity": tier.capacity,
                "evictions": tier.evictions + extra.get(f"{tier.name}_evictions", 0),
                "hits": hits, "served_bytes": served_bytes,
            }
            if tier is self.cache.ram:
                # Blocks read to their end by a pass, let go once the SSD tier had them.
                entry["released"] = stats.ram_released
            if tier is disk:
                entry |= {"writable": disk.writable, "writes": stats.disk_writes,
                          "write_queue_bytes": self.cache.queued
                          + extra.get(f"{LEVEL}write_queue_bytes", 0),
                          "chunks": disk.chunks.count, "packed_bytes": disk.chunks.live_bytes,
                          "chunk_reads": disk.chunks.reads,
                          # Blocks that came into RAM with an earlier member's chunk read.
                          "read_ahead": stats.disk_read_ahead}
            tiers.append(entry)
        hits = stats.ram_hits + stats.disk_hits + stats.shared_hits
        lookups = hits + stats.misses
        shared = self.cache.shared is not None
        return {
            "tiers": tiers,
            "misses": stats.misses,
            "single_flight_waits": stats.single_flight_waits,
            "lookups": lookups,
            # Of the lookups that ended in a tier or a GET (single-flight waits aside).
            "hit_ratio": {
                "ram": _ratio(stats.ram_hits, lookups),
                "ssd": _ratio(stats.disk_hits, lookups) if disk is not None else None,
                "shared": _ratio(stats.shared_hits, lookups) if shared else None,
                "total": _ratio(hits, lookups),
            },
        }

    def _shared(self) -> dict[str, Any] | None:
        """The shared tier's counters: what it served, what it was sent, what failed."""
        shared = self.cache.shared
        if shared is None:
            return None
        stats = shared.stats
        return {
            "url": shared.url, "endpoint": shared.store.endpoint, "up": shared.up,
            "max_object": shared.max_object,
            "lookups": stats.lookups, "hits": stats.hits, "misses": stats.misses,
            "invalid": stats.invalid, "errors": stats.errors, "skipped": stats.skipped,
            "bytes_read": stats.bytes_read, "writes": stats.writes,
            "bytes_written": stats.bytes_written, "dropped": stats.dropped,
            "write_queue_bytes": shared.queued, "requests": dict(stats.requests),
        }

    def _prefetch(self) -> dict[str, Any]:
        budget, extra = self.reader.budget, self._extra()
        out: dict[str, Any] = {
            "enabled": self.prefetch is not None,
            "readahead": {
                "prefetches": self.reader.prefetches + extra.get("reader_prefetches", 0),
                "inflight_bytes": budget.used + extra.get(f"{LEVEL}readahead_bytes", 0),
                "budget_bytes": budget.limit},
        }
        prefetch = self.prefetch
        if prefetch is None:
            return out
        stats = prefetch.current_stats()  # trio thread: as a scrape of /metrics copies them
        return out | {
            "window_limit": prefetch.scheduler.window_bytes,
            "budget_bytes": prefetch.scheduler.budget_bytes,
            "window_bytes": stats.window_bytes,
            "inflight_bytes": stats.inflight_bytes,
            "held_bytes": stats.held_bytes,
            "in_flight": sum(1 for _ in prefetch.scheduler.in_flight()),
            "connections": prefetch.concurrency.target,
            "max_connections": prefetch.connections,
            "hinted_files": stats.hinted_items,
            "started": stats.prefetches_started,
            "hits": stats.prefetch_hits,
            "late": stats.late_prefetches,
            "wasted": stats.wasted_prefetches,
            "failed": stats.failed_fetches,
            "orders": prefetch.orders,
            "next_orders": prefetch.next_orders,
            "refused_orders": prefetch.refused_orders,
            "failed_orders": prefetch.failed_orders,
            "unknown_paths": prefetch.unknown_paths,
        }

    def _origin(self) -> dict[str, Any]:
        counts = self._requests()
        requests = {kind: getattr(counts, kind) for kind in REQUEST_KINDS}
        now = time.monotonic()
        then = self._samples[0]
        since, old_bytes, old_requests = then.at, then.origin_bytes, then.origin_requests
        interval = now - since
        total = sum(requests.values())
        return {
            "requests": requests,
            "retries": counts.retries,
            "bytes": counts.bytes_fetched,
            "throughput": {
                "interval_s": round(interval, 1),
                "bytes_per_s": round((counts.bytes_fetched - old_bytes) / interval, 1)
                if interval > 0 else 0.0,
                "requests_per_s": round((total - old_requests) / interval, 1)
                if interval > 0 else 0.0,
            },
            "cost": request_cost(self.facts.scheme, requests),
        }

    def _load(self) -> dict[str, Any]:
        """The serving thread's share of a core (1: the mount's ceiling), its time per file
        opened and the files per second that allows (at the window's mix of work; None
        under PER_FILE_MIN_OPENS files), and the daemon's cores, over the window."""
        then, now = self._samples[0], self._now()
        interval = now.at - then.at
        if interval <= 0:
            return {"interval_s": 0.0, "serving_thread_busy": 0.0, "daemon_cores": 0.0,
                    "serving_ms_per_file": None, "files_per_s_ceiling": None}
        thread = now.thread_cpu_s - then.thread_cpu_s
        opens = now.opens - then.opens
        per_file = thread / opens if opens >= PER_FILE_MIN_OPENS and thread > 0 else None
        return {
            "interval_s": round(interval, 1),
            "serving_thread_busy": round(thread / interval, 3),
            "daemon_cores": round((now.process_cpu_s - then.process_cpu_s) / interval, 3),
            "serving_ms_per_file": None if per_file is None else round(1000 * per_file, 3),
            "files_per_s_ceiling": None if per_file is None else round(1 / per_file),
        }

    def _errors(self) -> dict[str, Any]:
        prefetch = self.prefetch
        return {
            "retries": self._requests().retries,
            "failed_orders": 0 if prefetch is None else prefetch.failed_orders,
            "failed_prefetches": 0 if prefetch is None else prefetch.current_stats().failed_fetches,
            "background_failures": tasks.failures,
            "failed_requests": sum(fs.request_failures.values())
            + self._extra().get("failed_reads", 0),
            "warm_errors": self.warm.errors,
        }


def request_cost(scheme: str, requests: dict[str, int]) -> dict[str, Any] | None:
    """The estimated cost of these requests at list prices; None for a store that has
    none (file://)."""
    prices = REQUEST_PRICES.get(scheme)
    if prices is None:
        return None
    usd = {kind: requests[kind] * prices[kind] / 1000 for kind in REQUEST_KINDS}
    return {
        "estimate": True,
        "prices": PRICE_NAMES[scheme],
        "usd_per_1000": dict(prices),
        "usd": {kind: round(value, 6) for kind, value in usd.items()}
        | {"total": round(sum(usd.values()), 6)},
    }


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None
