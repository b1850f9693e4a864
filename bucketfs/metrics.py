"""Every Prometheus metric of a mount, named in this one file.

Nothing is counted here: the cache, the object store and the reader keep plain integer
counters (and the store a fixed-bucket latency histogram) as they work, and
`MountCollector` reads them when Prometheus scrapes. So metrics add no work to the read
path, and a mount without `--metrics-port` pays nothing for them.

A scrape runs in the HTTP server's thread while the trio thread updates the counters.
Reading an int attribute is atomic, so each value is one the counter really had; values
read a moment apart may be a request apart, which a scrape tolerates.

Metrics (labels in braces):

  bucketfs_cache_hits_total{tier}             lookups served by a tier (ram, ssd, shared)
  bucketfs_cache_misses_total                 lookups fetched from the origin
  bucketfs_cache_served_bytes_total{tier}     bytes served from a tier (ram, ssd, shared)
  bucketfs_cache_single_flight_waits_total    lookups that waited for another's fetch
  bucketfs_cache_evictions_total{tier}        entries evicted from a tier
  bucketfs_cache_used_bytes{tier}             bytes held by a tier
  bucketfs_cache_capacity_bytes{tier}         byte budget of a tier
  bucketfs_cache_ssd_writes_total             blocks written through to the SSD tier
  bucketfs_cache_ssd_writable                 1 while the SSD tier takes writes, else 0
  bucketfs_cache_ram_released_total           blocks a reader read every byte of, let go
                                              from RAM as the SSD tier has them
  bucketfs_cache_write_queue_bytes            fetched bytes waiting to be written to SSD
  bucketfs_cache_ssd_chunks                   chunk files: small files packed in read order,
                                              or written through together
  bucketfs_cache_ssd_packed_bytes             bytes of the files held in chunk files
  bucketfs_cache_ssd_chunk_reads_total        preads of chunk files (one also brings the
                                              members after the one asked for)
  bucketfs_cache_ssd_read_ahead_total         blocks that came into RAM with the pread of
                                              an earlier member of their chunk
  bucketfs_cache_ssd_refused_total            SSD evictions refused: every candidate was in
                                              a reader's window (hinted eviction)
  bucketfs_cache_ssd_declined_total           blocks not stored on SSD: used later than
                                              anything they would evict (hinted, MIN's rule)
  bucketfs_packing_chunks_written_total       chunks of small files written
  bucketfs_packing_chunks_skipped_total       chunks not packed: the queue to the disk was full
  bucketfs_shared_requests_total{kind}        requests sent to the shared tier (get, put,
                                              list, delete); with cache.shared only
  bucketfs_shared_lookups_total{result}       its lookups: hit, miss, invalid (an object
                                              under the name that is not the block)
  bucketfs_shared_errors_total                its requests that failed (then it rests)
  bucketfs_shared_skipped_total               lookups and writes skipped while it rests
  bucketfs_shared_writes_total                blocks written to it
  bucketfs_shared_written_bytes_total         bytes written to it
  bucketfs_shared_dropped_total               blocks not shared: its write queue was full
  bucketfs_shared_write_queue_bytes           bytes waiting to be written to it
  bucketfs_shared_up                          1 unless it is resting after a failure
  bucketfs_origin_requests_total{kind}        requests sent (get, head, list), retries included
  bucketfs_origin_retries_total               requests retried after a transient error
  bucketfs_origin_bytes_total                 bytes fetched from the origin
  bucketfs_origin_request_seconds{kind}       histogram: time of one request in its worker
                                              thread (waiting for a connection slot excluded)
  bucketfs_fuse_opens_total                   files opened as the daemon sees them (with
                                              kernel_opens: reads at a file's start)
  bucketfs_fuse_reads_total                   read requests the kernel sent (its page cache
                                              answers the rest without asking)
  bucketfs_fuse_read_bytes_total              bytes those read requests returned
  bucketfs_fuse_errors_total{operation}       requests answered EIO (a failure of the
                                              bucket after the retries, or a bug)
  bucketfs_data_processes                     processes serving reads beside the daemon
  bucketfs_data_process_restarts_total        data processes started again after one exited
  bucketfs_data_process_cpu_seconds_total     CPU of the data processes, as last reported
  bucketfs_readahead_prefetches_total         blocks read ahead
  bucketfs_readahead_inflight_bytes           bytes read-ahead has in flight now
  bucketfs_readahead_budget_bytes             most bytes read-ahead may have in flight
  bucketfs_buffers_reused_total               large GETs given the memory of a block the RAM
                                              tier let go (spare_buffers.py)
  bucketfs_buffers_fresh_total                large GETs given fresh memory
  bucketfs_buffers_read_reused_total          large blocks read from SSD into the mapping of
                                              a block the RAM tier let go
  bucketfs_buffers_read_fresh_total           large blocks read from SSD into fresh memory
  bucketfs_buffers_spare_bytes                memory of let-go blocks waiting to be reused
  bucketfs_hints_orders_total                 access orders received on the hints socket
  bucketfs_hints_next_orders_total            next epochs' orders announced ahead
  bucketfs_hints_refused_orders_total         orders refused: too many being resolved
  bucketfs_hints_failed_orders_total          orders dropped: resolving them failed
  bucketfs_hints_unknown_paths_total          hinted paths that named no file
  bucketfs_hints_files                        hinted files not yet read (all jobs' plans)
  bucketfs_prefetch_started_total             hinted files whose prefetch started
  bucketfs_prefetch_hits_total                opens that found their file prefetched
  bucketfs_prefetch_late_total                opens that found its prefetch in flight
  bucketfs_prefetch_wasted_total              prefetched files evicted before being read
  bucketfs_prefetch_failed_total              prefetches that failed after the retries
  bucketfs_prefetch_window_bytes              bytes planned ahead of the readers, unread
  bucketfs_prefetch_inflight_bytes            bytes of prefetches in flight
  bucketfs_prefetch_held_bytes                bytes prefetched and not yet read
  bucketfs_background_failures_total          background tasks that failed (logged, the
                                              mount went on)
  bucketfs_serving_thread_cpu_seconds_total   CPU of the thread that answers every FUSE
                                              request: its rate near 1 is the mount's
                                              ceiling of files/s (loop_load.py)
  bucketfs_daemon_cpu_seconds_total           CPU of the daemon, all its threads

With data processes (`data_processes`), the cache, origin and fuse series add what
they counted, as each last reported (once a second; those of a process that exited
are kept), and the data_process series exist; their request latencies are not in the
histogram. The ssd-tier series exist only when the mount has an SSD tier; the hints and prefetch
series only when hinted prefetch is on (hints.prefetch_window > 0). The prefetch values
are a snapshot the trio thread refreshes at every event (the scheduler is not
thread-safe).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from bucketfs import fs, tasks
from bucketfs.backends.store import LatencyHistogram, ObjectStore
from bucketfs.cache.shared import SharedTier
from bucketfs.cache.tiered import BlockCache
from bucketfs.data_jobs import LEVEL, Counts, merged
from bucketfs.dispatch import DataProcesses
from bucketfs.loop_load import ServingLoad
from bucketfs.prefetcher import HintedPrefetch
from bucketfs.reader import Reader
from bucketfs.spare_buffers import spare_buffers

#: Where the metrics endpoint listens unless told otherwise: this host only.
DEFAULT_ADDRESS = "127.0.0.1"

PREFIX = "bucketfs_"
REQUEST_KINDS = ("get", "head", "list")


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, labels=labels)


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def _cumulative(histogram: LatencyHistogram) -> list[tuple[str, float]]:
    """Cumulative buckets in Prometheus form; the +Inf one is the count."""
    counts = list(histogram.counts)  # one copy, so the buckets and the count agree
    buckets, total = [], 0
    for bound, count in zip((*histogram.bounds, float("inf")), counts, strict=True):
        total += count
        buckets.append((floatToGoString(bound), total))
    return buckets


class MountCollector(Collector):
    """Reads the counters of one mount's cache, object store and reader at scrape time."""

    def __init__(self, cache: BlockCache, store: ObjectStore, reader: Reader,
                 prefetch: HintedPrefetch | None = None, load: ServingLoad | None = None,
                 data: DataProcesses | None = None) -> None:
        self.cache = cache
        self.store = store
        self.reader = reader
        self.prefetch = prefetch
        self.load = load
        self.data = data
        #: The data processes' counters, read once per scrape (this thread reads what
        #: the trio thread replaces whole, a report at a time).
        self.extra: Counts = {}

    def collect(self) -> Iterator[Metric]:
        self.extra = {} if self.data is None else self.data.counts()
        yield from self._cache()
        yield from self._origin()
        if self.cache.shared is not None:
            yield from self._shared(self.cache.shared)
        yield from self._reads()
        yield from self._readahead()
        yield from self._buffers()
        if self.prefetch is not None:
            yield from self._hints(self.prefetch)
        yield CounterMetricFamily(
            PREFIX + "background_failures_total",
            "Background tasks that failed (each logged; the mount went on).",
            value=tasks.failures)
        if self.load is not None:
            yield CounterMetricFamily(
                PREFIX + "serving_thread_cpu_seconds_total",
                "CPU seconds of the thread that answers every FUSE request; a rate near 1 "
                "is the mount's ceiling of files per second.", value=self.load.thread_cpu_s())
            yield CounterMetricFamily(
                PREFIX + "daemon_cpu_seconds_total",
                "CPU seconds of the daemon, all its threads.", value=self.load.process_cpu_s())

    def _cache(self) -> Iterator[Metric]:
        stats, disk, extra = self.cache.stats, self.cache.disk, self.extra
        if self.data is not None:
            stats = merged(stats, extra, "cache_")
        hits = _counter("cache_hits_total", "Block lookups served by a cache tier.", ("tier",))
        served = _counter("cache_served_bytes_total", "Bytes served from a cache tier.",
                          ("tier",))
        evictions = _counter("cache_evictions_total", "Entries evicted from a cache tier.",
                             ("tier",))
        used = _gauge("cache_used_bytes", "Bytes held by a cache tier.", ("tier",))
        capacity = _gauge("cache_capacity_bytes", "Byte budget of a cache tier.", ("tier",))
        served_by = {"ram": (stats.ram_hits, stats.ram_bytes_served),
                     "ssd": (stats.disk_hits, stats.disk_bytes_served)}
        for tier in self.cache.tiers:
            tier_hits, tier_bytes = served_by[tier.name]
            hits.add_metric([tier.name], tier_hits)
            served.add_metric([tier.name], tier_bytes)
            evictions.add_metric([tier.name],
                                 tier.evictions + extra.get(f"{tier.name}_evictions", 0))
            used.add_metric([tier.name], tier.used + extra.get(f"{LEVEL}{tier.name}_used", 0))
            capacity.add_metric([tier.name], tier.capacity)
        if self.cache.shared is not None:
            hits.add_metric(["shared"], stats.shared_hits)
            served.add_metric(["shared"], stats.shared_bytes_served)
        yield from (hits, served, evictions, used, capacity)
        yield CounterMetricFamily(
            PREFIX + "cache_misses_total", "Block lookups fetched from the origin.",
            value=stats.misses)
        yield CounterMetricFamily(
            PREFIX + "cache_single_flight_waits_total",
            "Block lookups that waited for another reader's fetch of the same block.",
            value=stats.single_flight_waits)
        if disk is not None:
            yield CounterMetricFamily(
                PREFIX + "cache_ssd_writes_total", "Blocks written through to the SSD tier.",
                value=stats.disk_writes)
            yield CounterMetricFamily(
                PREFIX + "cache_ram_released_total",
                "Blocks a reader read every byte of, let go from RAM because the SSD "
                "tier has them (the page cache holds the bytes).",
                value=stats.ram_released)
            yield GaugeMetricFamily(
                PREFIX + "cache_ssd_writable",
                "1 while the SSD tier takes writes; 0 once it stepped aside (full, read-only).",
                value=int(disk.writable))
            yield GaugeMetricFamily(
                PREFIX + "cache_write_queue_bytes",
                "Fetched bytes waiting to be written through to the SSD tier.",
                value=self.cache.queued)
            chunks = disk.chunks
            yield GaugeMetricFamily(
                PREFIX + "cache_ssd_chunks",
                "Chunk files on the SSD tier (small files packed in read order, or written "
                "through together).",
                value=chunks.count)
            yield GaugeMetricFamily(
                PREFIX + "cache_ssd_packed_bytes",
                "Bytes of the files held in chunk files on the SSD tier.",
                value=chunks.live_bytes)
            yield CounterMetricFamily(
                PREFIX + "cache_ssd_chunk_reads_total",
                "Reads (preads) of chunk files; one also brings the members after the one "
                "asked for.", value=chunks.reads)
            yield CounterMetricFamily(
                PREFIX + "cache_ssd_read_ahead_total",
                "Blocks that came into RAM with the pread of an earlier member of their "
                "chunk.", value=stats.disk_read_ahead)
            hinted = disk.hinted  # without hints there is nothing to refuse or decline
            yield CounterMetricFamily(
                PREFIX + "cache_ssd_refused_total",
                "SSD evictions refused: every candidate was in a reader's window.",
                value=0 if hinted is None else hinted.refused)
            yield CounterMetricFamily(
                PREFIX + "cache_ssd_declined_total",
                "Blocks not stored on SSD: used later than anything they would evict.",
                value=0 if hinted is None else hinted.declined)

    def _shared(self, shared: SharedTier) -> Iterator[Metric]:
        stats = shared.stats
        requests = _counter("shared_requests_total",
                            "Requests sent to the shared tier.", ("kind",))
        for kind, count in stats.requests.items():
            requests.add_metric([kind], count)
        lookups = _counter("shared_lookups_total",
                           "Block lookups in the shared tier, by result.", ("result",))
        for result, count in (("hit", stats.hits), ("miss", stats.misses),
                              ("invalid", stats.invalid)):
            lookups.add_metric([result], count)
        yield from (requests, lookups)
        for name, doc, value in (
            ("shared_errors_total", "Shared-tier requests that failed.", stats.errors),
            ("shared_skipped_total", "Shared-tier lookups and writes skipped while it "
             "rests after a failure.", stats.skipped),
            ("shared_writes_total", "Blocks written to the shared tier.", stats.writes),
            ("shared_written_bytes_total", "Bytes written to the shared tier.",
             stats.bytes_written),
            ("shared_dropped_total", "Blocks not shared: the write queue was full.",
             stats.dropped),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(
            PREFIX + "shared_write_queue_bytes",
            "Bytes waiting to be written to the shared tier.", value=shared.queued)
        yield GaugeMetricFamily(
            PREFIX + "shared_up", "1 unless the shared tier rests after a failure.",
            value=int(shared.up))

    def _origin(self) -> Iterator[Metric]:
        counts = self.store.counts
        if self.data is not None:
            counts = merged(counts, self.extra, "origin_")
        requests = _counter("origin_requests_total",
                            "Requests sent to the origin, retries included.", ("kind",))
        for kind in REQUEST_KINDS:
            requests.add_metric([kind], getattr(counts, kind))
        yield requests
        yield CounterMetricFamily(
            PREFIX + "origin_retries_total",
            "Origin requests retried after a transient error.", value=counts.retries)
        yield CounterMetricFamily(
            PREFIX + "origin_bytes_total", "Bytes fetched from the origin.",
            value=counts.bytes_fetched)
        latency = HistogramMetricFamily(
            PREFIX + "origin_request_seconds",
            "Time of one origin request in its worker thread (waiting for a slot excluded).",
            labels=("kind",))
        for kind in REQUEST_KINDS:
            histogram = self.store.latency[kind]
            latency.add_metric([kind], _cumulative(histogram), histogram.sum)
        yield latency

    def _reads(self) -> Iterator[Metric]:
        reader, extra = self.reader, self.extra
        yield CounterMetricFamily(
            PREFIX + "fuse_opens_total",
            "Files opened as the daemon sees them (with kernel_opens: reads at their start).",
            value=reader.opens + extra.get("reader_opens", 0))
        yield CounterMetricFamily(
            PREFIX + "fuse_reads_total", "Read requests the kernel sent to the daemon.",
            value=reader.reads + extra.get("reader_reads", 0))
        yield CounterMetricFamily(
            PREFIX + "fuse_read_bytes_total", "Bytes returned to the kernel's read requests.",
            value=reader.bytes_read + extra.get("reader_bytes_read", 0))
        errors = _counter("fuse_errors_total",
                          "Requests answered EIO (the bucket failed after the retries, or a bug).",
                          ("operation",))
        failures = dict(fs.request_failures)
        if extra.get("failed_reads"):  # answered EIO by a data process
            failures["read"] = failures.get("read", 0) + extra["failed_reads"]
        for operation, count in sorted(failures.items()):
            errors.add_metric([operation], count)
        yield errors
        if self.data is not None:
            yield GaugeMetricFamily(
                PREFIX + "data_processes", "Processes serving reads beside the daemon.",
                value=self.data.count)
            yield CounterMetricFamily(
                PREFIX + "data_process_restarts_total",
                "Data processes started again after one exited.", value=self.data.restarts)
            yield CounterMetricFamily(
                PREFIX + "data_process_cpu_seconds_total",
                "CPU seconds of the data processes, as they last reported them.",
                value=extra.get("cpu_us", 0) / 1e6)

    def _readahead(self) -> Iterator[Metric]:
        budget = self.reader.budget
        yield CounterMetricFamily(
            PREFIX + "readahead_prefetches_total", "Blocks read ahead.",
            value=self.reader.prefetches)
        yield GaugeMetricFamily(
            PREFIX + "readahead_inflight_bytes", "Bytes read-ahead has in flight now.",
            value=budget.used)
        yield GaugeMetricFamily(
            PREFIX + "readahead_budget_bytes",
            "Most bytes read-ahead may have in flight across all open files.",
            value=budget.limit)

    def _buffers(self) -> Iterator[Metric]:
        for name, doc, value in (
            ("buffers_reused_total", "Large GETs given the memory of a block the RAM tier "
             "let go.", spare_buffers.reused),
            ("buffers_fresh_total", "Large GETs given fresh memory.", spare_buffers.fresh),
            ("buffers_read_reused_total", "Large blocks read from SSD into the mapping of "
             "a block the RAM tier let go.", spare_buffers.reads.reused),
            ("buffers_read_fresh_total", "Large blocks read from SSD into fresh memory.",
             spare_buffers.reads.fresh),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(
            PREFIX + "buffers_spare_bytes",
            "Memory of blocks let go, waiting to be reused by a GET or a read from SSD.",
            value=spare_buffers.spare_bytes + spare_buffers.reads.spare_bytes)


    def _hints(self, prefetch: HintedPrefetch) -> Iterator[Metric]:
        # Copied by the trio thread for this scrape: the scheduler itself is not
        # thread-safe, and scrapes come from the server's thread.
        stats = prefetch.stats_from_thread()
        for name, doc, value in (
            ("hints_orders_total", "Access orders received on the hints socket.",
             prefetch.orders),
            ("hints_next_orders_total", "Next epochs' orders announced ahead.",
             prefetch.next_orders),
            ("hints_refused_orders_total", "Orders refused: too many were being resolved.",
             prefetch.refused_orders),
            ("hints_failed_orders_total", "Orders dropped: resolving them failed.",
             prefetch.failed_orders),
            ("hints_unknown_paths_total", "Hinted paths that named no file.",
             prefetch.unknown_paths),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        if prefetch.packing is not None:
            yield CounterMetricFamily(
                PREFIX + "packing_chunks_written_total", "Chunks of small files written.",
                value=prefetch.packing.chunks_written)
            yield CounterMetricFamily(
                PREFIX + "packing_chunks_skipped_total",
                "Chunks not packed: the queue to the disk was full.",
                value=prefetch.packing.chunks_skipped)
        yield GaugeMetricFamily(
            PREFIX + "hints_files", "Hinted files not yet read, over all jobs' plans.",
            value=stats.hinted_items)
        for name, doc, value in (
            ("prefetch_started_total", "Hinted files whose prefetch started.",
             stats.prefetches_started),
            ("prefetch_hits_total", "Opens that found their file already prefetched.",
             stats.prefetch_hits),
            ("prefetch_late_total", "Opens that found their file's prefetch still in flight.",
             stats.late_prefetches),
            ("prefetch_wasted_total", "Prefetched files evicted before they were read.",
             stats.wasted_prefetches),
            ("prefetch_failed_total", "Prefetches that failed after the retries.",
             stats.failed_fetches),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        for name, doc, value in (
            ("prefetch_window_bytes", "Bytes planned ahead of the readers and not yet read.",
             stats.window_bytes),
            ("prefetch_inflight_bytes", "Bytes of prefetches in flight.", stats.inflight_bytes),
            ("prefetch_held_bytes", "Bytes prefetched and not yet read.", stats.held_bytes),
        ):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)


def build_registry(cache: BlockCache, store: ObjectStore, reader: Reader,
                   prefetch: HintedPrefetch | None = None, load: ServingLoad | None = None,
                   data: DataProcesses | None = None) -> CollectorRegistry:
    """A fresh registry holding only this mount's metrics (never the process-global one).
    `load`: the serving thread's clocks (its series are there only with it). `data`:
    the mount's data processes, whose counters add to this process's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MountCollector(cache, store, reader, prefetch, load, data))
    return registry


def start_metrics_server(port: int, address: str, registry: CollectorRegistry) -> None:
    """Serve `registry` on http://address:port/metrics from a daemon thread.

    Raises OSError if the address cannot be bound (port taken, address not local)."""
    start_http_server(port, addr=address, registry=registry)
